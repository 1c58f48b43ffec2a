"""Document masking (block_causal): the trainer's document feed and its pre-launch check."""
