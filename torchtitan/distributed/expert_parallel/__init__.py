"""Expert parallel (experts sharded over the EP mesh) and global-batch MoE balance."""
