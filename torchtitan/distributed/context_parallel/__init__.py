"""Context parallel: sequence sharding, ring attention (ours and torch's) and its checks."""
