"""Tensor parallel: the plans (sequence and loss parallel, LoRA's styles), async TP, checks."""
