"""Pre-launch: what the step replay (``training.replay_every_n_steps``) cannot compose with (light: the preflight
runs it; the replay itself is features/replay/replay.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims


def check_replay(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Before launch: one line per combination the replay refuses.

    Raises:
        NotImplementedError / ValueError: naming the conflicting key, why, and what to set.
    """
    t = config.training
    if t.replay_every_n_steps == 0:
        return []
    key = f"training.replay_every_n_steps = {t.replay_every_n_steps}"
    if not t.deterministic:
        raise ValueError(
            f"{key} needs training.deterministic = true: the replay compares two passes bit for bit, and "
            "non-deterministic kernels differ between them (every replay would be reported as corruption)"
        )
    refused = (
        (dims.pp_enabled, f"experimental.pipeline_parallel_degree = {dims.pp}: the schedule runs its own passes"),
        (
            config.optimizer.early_step_in_backward,
            "optimizer.early_step_in_backward = true: the weights change during the first backward",
        ),
    )
    for bad, why in refused:
        if bad:
            raise NotImplementedError(f"{key} with {why}; set training.replay_every_n_steps = 0 or change that")
    return []
