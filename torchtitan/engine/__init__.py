"""The engine: a run's parts built in one typed, ordered pass through swappable builders.

The pass is parts.py, the builders builders.py, the start summary summary.py; the loop (train.py) and the memory
estimator drive those parts.
"""
