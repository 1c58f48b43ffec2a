"""The memory estimator behind estimation.py: the trainer's own build and step on fake tensors.

fake_trainer.py  the trainer's builders pointed at fake inputs, and the fake-mode patches of torch internals
tracker.py       two steps of the run's step runner under torch's FSDPMemTracker/MemTracker
foreach.py       the foreach optimizer step's temporaries, modeled instead of tracked
estimate.py      validation, what cannot be modeled, one fake rank per role
measure.py       the same on real tensors under torchrun, plus peak RSS (accuracy tests)
plan.py          the layout planner's per-rank terms; images.py the image batches of a vision estimate
report.py cli.py output and the command line
"""
