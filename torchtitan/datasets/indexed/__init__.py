"""Megatron-LM's indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``): the format (format.py), weighted blends
(blend.py), the memory-mapped, layout-invariant loader (loader.py) and the pre-launch check (checks.py).

Import from the modules: checks.py (run before every launch) needs nothing of the data stack.
"""
