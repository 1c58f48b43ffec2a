"""Evaluation during training (``[eval]``): lm-eval tasks on the live model every ``eval.freq`` steps."""
