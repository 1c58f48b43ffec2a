"""Megatron-LM's indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``): format, blends, loader, check.

The format (format.py), weighted blends (blend.py), the layout-invariant loader that reads windows on demand (loader.py) and the pre-launch check (checks.py).

Import from the modules: checks.py (run before every launch) needs nothing of the data stack.
"""
