"""The memory estimator behind estimation.py: the trainer's own build and step on fake tensors.

fake_trainer.py  the Trainer subclass (build hooks only) and the fake-mode patches
tracker.py       two steps under torch's FSDPMemTracker/MemTracker; the foreach correction
estimate.py      validation, what cannot be modeled, one fake rank per role
measure.py       the same on real tensors under torchrun, plus peak RSS (accuracy tests)
report.py cli.py output and the command line
"""
