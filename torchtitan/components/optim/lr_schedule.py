"""The learning-rate schedules (pure math: the factor ``LambdaLR`` multiplies ``optimizer.lr`` by) and their check.

``training.lr_schedule`` picks one:

* ``linear`` (the default; torchtitan late 2024): warmup ``(step+1)/(warmup+1)``, then linear decay toward
  0 at ``training.steps`` (``compute_lr_factor``). The loss-parity tests' golden losses depend on it bit
  for bit: keep it as it is.
* ``wsd``: torchtitan 2025's warmup-stable-decay (its ``components/lr_scheduler.py``, the ``[lr_scheduler]``
  section): warmup ``(step+1)/warmup``, a constant stretch, then the last ``lr_decay_ratio`` of the steps
  decay (linear, sqrt or cosine) from 1 to ``lr_min_factor`` (``compute_wsd_lr_factor``, the same
  expressions as upstream's, so the factors are the same floats).

``step`` is the number of optimizer steps already taken (``LambdaLR``'s ``last_epoch``): the factor at
``step`` applies to optimizer step ``step + 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchtitan.config.errors import ConfigError
from torchtitan.config.schema import Training

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims


def compute_lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier before optimizer step ``step + 1``: linear warmup, then linear decay toward 0.

    Warmup: (step+1)/(warmup+1), so the first step already moves. Decay: from 1 down to
    1/(decay_steps+1) at the last step (never exactly 0, which would waste the step).
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(1, total_steps - warmup_steps)
    return 1.0 - (step - warmup_steps) / (decay_steps + 1)


@dataclass(frozen=True)
class WsdPhases:
    """The step counts of a warmup-stable-decay schedule; ``stable`` includes upstream's virtual last step."""

    warmup: int
    stable: int
    decay: int
    notes: tuple[str, ...] = ()  # what was shortened to fit ``training.steps`` (upstream warns the same)


def wsd_phases(training: Training) -> WsdPhases:
    """Upstream's phase lengths: warmup capped at ``steps``, decay capped at what warmup leaves."""
    steps, warmup, notes = training.steps, training.warmup_steps, []
    if warmup > steps:
        notes.append(f"training.warmup_steps ({warmup}) exceeds training.steps ({steps}): warmup lasts {steps} steps")
        warmup = steps
    decay = steps - warmup
    if training.lr_decay_ratio is not None:
        decay = round(steps * training.lr_decay_ratio)
        if warmup + decay > steps:
            notes.append(
                f"warmup ({warmup}) + decay ({decay} = round(training.steps x lr_decay_ratio)) steps exceed "
                f"training.steps ({steps}): decay lasts {steps - warmup} steps"
            )
            decay = steps - warmup
    # A virtual last step keeps the last real step's factor above 0 (upstream's comment: "to prevent the
    # learning rate from dropping to 0").
    return WsdPhases(warmup=warmup, stable=steps + 1 - warmup - decay, decay=decay, notes=tuple(notes))


def compute_wsd_lr_factor(step: int, phases: WsdPhases, decay_type: str, min_lr_factor: float) -> float:
    """Upstream's ``linear_warmup_stable_decay`` (torchtitan 2025), expression for expression."""
    if step < phases.warmup:
        return float((step + 1) / phases.warmup)
    if step < phases.warmup + phases.stable:
        return 1.0
    progress = float((step + 1) - (phases.warmup + phases.stable)) / phases.decay
    if decay_type == "linear":
        factor = 1 - progress
    elif decay_type == "sqrt":
        factor = 1 - math.sqrt(progress)
    elif decay_type == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # the schema's Literal allows only the three
        raise AssertionError(f"unknown decay type {decay_type!r}")
    return min_lr_factor + (1 - min_lr_factor) * factor


def lr_factor_fn(training: Training):
    """``step -> factor`` for the configured schedule (what ``LambdaLR`` calls)."""
    if training.lr_schedule == "linear":
        return lambda step: compute_lr_factor(step, training.warmup_steps, training.steps)
    phases = wsd_phases(training)
    return lambda step: compute_wsd_lr_factor(step, phases, training.lr_decay_type, training.lr_min_factor)


_WSD_ONLY = (("lr_decay_ratio", None), ("lr_decay_type", "linear"), ("lr_min_factor", 0.0))


def check_lr_schedule(config: JobConfig, dims: ParallelDims) -> list[str]:
    """The wsd keys need ``lr_schedule = 'wsd'``; wsd phases shortened to fit ``steps`` are warned about.

    Raises:
        ConfigError: a wsd-only key set under the ``linear`` schedule (it would have no effect).
    """
    t = config.training
    if t.lr_schedule == "linear":
        for name, default in _WSD_ONLY:
            if getattr(t, name) != default:
                raise ConfigError(
                    f"training.{name} = {getattr(t, name)!r} shapes the 'wsd' schedule, but training.lr_schedule = "
                    f"'linear'; set training.lr_schedule = 'wsd' (torchtitan 2025's warmup-stable-decay) or remove it"
                )
        return []
    return list(wsd_phases(t).notes)
