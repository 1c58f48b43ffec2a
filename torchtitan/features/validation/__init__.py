"""Validation: the held-out loss every validation.freq steps (the after_step seam)."""
