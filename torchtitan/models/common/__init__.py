"""What the model families share, written once: attention, masks, init, RoPE, the HF toolkit.

Attention kernels and document masks, weight init, RoPE (YaRN's table; HF's RoPE config read and written one way)
and the Hugging Face conversion toolkit; a layered model's ends (ends.py: what a pipeline stage keeps of them).
"""
