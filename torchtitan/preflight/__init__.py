"""The pre-launch check: every feature's own check, in the registry's order, before any process group exists.

Run by ``python -m torchtitan.preflight``, the trainer's ``run_job`` and the estimator.

This layer sits on top: it is the one place that knows every feature. Each check lives in a light
module beside its feature (no DTensor, DCP, pipelining or data stack is imported to run them) and has
one signature, ``check(config, dims) -> warnings`` (a check of the device kind also takes ``device_type``:
registry.py's ``Check``), raising ConfigError / NotImplementedError / FileNotFoundError with a message
naming the key, the value, what is allowed and how to fix it.
"""

from torchtitan.preflight.checks import CHECKS, Check, run_preflight

__all__ = ["CHECKS", "Check", "run_preflight"]
