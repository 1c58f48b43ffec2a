"""Optimizers and learning-rate schedules: AdamW, Muon, low-precision states, parameter groups."""
