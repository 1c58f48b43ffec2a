"""Optional features, one folder each (its config's code, pre-launch check and build); imports nothing."""
