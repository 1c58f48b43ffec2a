"""Run a function on N CPU processes joined by a gloo process group, and collect what each returns.

The processes are the test run's worker pool of that world size (tests/support/pool.py): started once,
each with its own RNG and torch state like torchrun's ranks, one thread per rank, the default
group held for the whole run and the job's own groups destroyed after it. Every job has a
deadline, so a collective mismatch fails the test (and restarts the pool) instead of hanging it.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.support.pool import run_in_pool


def run_distributed(fn: Callable, world_size: int, *args, timeout_s: float = 300) -> list:
    """fn(rank, world_size, *args) on each rank (fn must be importable); returns results by rank."""
    return run_in_pool(fn, world_size, *args, timeout_s=timeout_s)
