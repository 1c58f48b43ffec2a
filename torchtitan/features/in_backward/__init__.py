"""The optimizer step in backward (per-parameter, freeing gradients early) and its check."""
