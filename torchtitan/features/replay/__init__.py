"""Step replay: re-run a step and compare (silent data corruption), and its pre-launch check."""
