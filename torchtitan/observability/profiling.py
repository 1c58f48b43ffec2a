"""Periodic torch.profiler traces and CUDA memory snapshots of the training loop.

Both are context managers around the loop; the caller calls `.step()` once per training step
on whatever they yield (when it is not None).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from torchtitan.config.errors import ConfigError

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)

# Memory history entries kept; enough for several steps of a large model at ~100 B each.
_MAX_MEMORY_EVENTS = 100_000


def _profiler_activities() -> list[ProfilerActivity]:
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return activities


def _trace_path(trace_dir: str, step: int | str, rank: int, suffix: str) -> str:
    step_dir = os.path.join(trace_dir, f"iteration_{step}")
    os.makedirs(step_dir, exist_ok=True)
    return os.path.join(step_dir, f"rank{rank}_{suffix}")


def _offset_schedule(profile_freq: int, warmup: int, active: int, global_step: int) -> Callable[[int], ProfilerAction]:
    """A schedule recording the last `active` steps of every `profile_freq` training steps, after `warmup`
    unrecorded ones (so the profiler's own start-up cost falls outside the trace).

    The profiler counts steps from 0 on each (re)start, so the training step it is at is
    `global_step + profiler_step + 1`; offsetting keeps resumed runs tracing the same steps as
    uninterrupted ones.
    """
    base = torch.profiler.schedule(wait=profile_freq - warmup - active, warmup=warmup, active=active)
    return lambda profiler_step: base(profiler_step + global_step)


def _check_profile_freq(profile_freq: int, minimum: int) -> None:
    if profile_freq < minimum:
        raise ValueError(f"profile_freq must be >= {minimum} (got {profile_freq}); set a larger profiling.profile_freq")


@contextlib.contextmanager
def maybe_enable_profiling(
    enable: bool,
    *,
    trace_dir: str,
    profile_freq: int,
    warmup: int = 1,
    active: int = 1,
    global_step: int = 0,
    rank: int = 0,
) -> Iterator[torch.profiler.profile | None]:
    """Yield a profiler that traces the `active` training steps ending at step k * `profile_freq` for
    every k, or None.

    Each trace goes to `<trace_dir>/iteration_<step>/rank<rank>_trace.json` (Chrome trace
    format; open it in Perfetto or chrome://tracing), named by the window's last step.

    Args:
        warmup: unrecorded steps the profiler runs before each window.
        global_step: the step the run resumes from (0 for a fresh run).

    Raises:
        ValueError: `profile_freq` < `warmup` + `active`.
    """
    if not enable:
        yield None
        return
    _check_profile_freq(profile_freq, warmup + active)

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        # Called from prof.step() right after the recorded step, so step_num has moved past it.
        step = global_step + prof.step_num
        if step % profile_freq != 0:
            # Leaving the context mid-window also fires this, for a step that never ran.
            logger.debug("dropping partial profiler trace at exit after step %d", step)
            return
        path = _trace_path(trace_dir, step, rank, "trace.json")
        start = time.perf_counter()
        prof.export_chrome_trace(path)
        logger.info("wrote profiler trace %s in %.2f s", path, time.perf_counter() - start)

    logger.info("profiling every %d steps into %s", profile_freq, trace_dir)
    with torch.profiler.profile(
        activities=_profiler_activities(),
        schedule=_offset_schedule(profile_freq, warmup, active, global_step),
        on_trace_ready=on_trace_ready,
        record_shapes=True,
    ) as prof:
        yield prof


class MemorySnapshotter:
    """Dumps a CUDA allocator snapshot every `profile_freq` steps (use via the context manager)."""

    def __init__(
        self,
        snapshot_dir: str,
        profile_freq: int,
        device: torch.device,
        global_step: int,
        rank: int,
    ) -> None:
        self.snapshot_dir = snapshot_dir
        self.profile_freq = profile_freq
        self.device = device
        self.step_num = global_step
        self.rank = rank

    def step(self, exited_with_oom: bool = False) -> None:
        """Advance one training step; also dump now when the step ran out of memory."""
        self.step_num += 1
        if exited_with_oom:
            self._dump(f"{self.step_num}_exit")
        elif self.step_num % self.profile_freq == 0:
            self._dump(str(self.step_num))

    def _dump(self, step_label: str) -> None:
        path = _trace_path(self.snapshot_dir, step_label, self.rank, "memory_snapshot.pickle")
        start = time.perf_counter()
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(self.device), f)
        logger.info("wrote memory snapshot %s in %.2f s", path, time.perf_counter() - start)


@contextlib.contextmanager
def maybe_enable_memory_snapshot(
    enable: bool,
    *,
    snapshot_dir: str,
    profile_freq: int,
    device: torch.device,
    global_step: int = 0,
    rank: int = 0,
) -> Iterator[MemorySnapshotter | None]:
    """Yield a `MemorySnapshotter` recording CUDA allocator history, or None.

    Snapshots go to `<snapshot_dir>/iteration_<step>/rank<rank>_memory_snapshot.pickle`; view
    them at https://pytorch.org/memory_viz. Only CUDA has an allocator history, so on any other
    device it is an error (the pre-launch check refuses it first).
    """
    if not enable:
        yield None
        return
    if device.type != "cuda":
        raise NotImplementedError(
            f"profiling.enable_memory_snapshot = true: memory snapshots need a CUDA device, not "
            f"'{device.type}'; set it to false"
        )
    _check_profile_freq(profile_freq, 1)
    torch.cuda.memory._record_memory_history(max_entries=_MAX_MEMORY_EVENTS, device=device)
    logger.info("memory snapshot every %d steps into %s", profile_freq, snapshot_dir)
    try:
        yield MemorySnapshotter(snapshot_dir, profile_freq, device, global_step, rank)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)


def check_profiling(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Pre-launch: each window of ``profile_freq`` steps holds the warmup and the recorded steps."""
    p = config.profiling
    if p.enable_profiling and p.profile_freq < p.profiler_warmup + p.profiler_active:
        raise ConfigError(
            f"profiling.profile_freq = {p.profile_freq} with profiling.enable_profiling = true: each window holds "
            f"profiler_warmup ({p.profiler_warmup}) + profiler_active ({p.profiler_active}) steps; set profile_freq "
            f">= {p.profiler_warmup + p.profiler_active}"
        )
    return []


def check_memory_snapshot_device(config: JobConfig, dims: ParallelDims, device_type: str) -> list[str]:
    """On ``device_type``: memory snapshots are CUDA's allocator history."""
    if config.profiling.enable_memory_snapshot and device_type != "cuda":
        raise NotImplementedError(
            "profiling.enable_memory_snapshot = true: memory snapshots are CUDA's allocator history and the run "
            f"trains on {device_type!r}; set it to false (profiling.enable_profiling traces CPU memory)"
        )
    return []
