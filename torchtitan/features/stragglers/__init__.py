"""Straggler detection: ranks whose steps run slower than the others."""
