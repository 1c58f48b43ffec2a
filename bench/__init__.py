"""Benchmarks that print JSON; each runs from the repository root as ``python -m bench.<name>`` (not tests)."""
