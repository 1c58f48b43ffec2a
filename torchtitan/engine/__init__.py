"""The engine: a run's parts built in one typed, ordered pass (parts.py) through swappable builders (builders.py);
the loops (train.py's pre-training loop, the memory estimator) drive those parts."""
