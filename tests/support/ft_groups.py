"""Fault-tolerant jobs in the tests: a torchft lighthouse and replica groups on this machine (loopback only).

Each replica group is a ``WorkerPool`` of its own (tests/support/pool.py: workers forked from the preloaded server, so a
group is ready in a fraction of a second), running the trainer's ``run_job`` as a pool job; groups run side by
side, one thread each. The shared pools (one per world size) cannot serve here: each group needs its own process
group, and the groups must run at the same time. What needs a launcher and signals (SIGKILL to a group's whole
process group, a restart with the same command) is in tests/runs/reliability/test_fault_tolerance_runs.py, through
run_llama_train.sh.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tests.support.pool import JobFailed, PoolBroken, WorkerPool, train_job
from torchtitan.features.fault_tolerance.lighthouse import start_lighthouse

# The lighthouse of the tests: a quorum re-checked every 50 ms, a silent group dropped after 1 s.
LIGHTHOUSE = dict(quorum_tick_ms=50, heartbeat_timeout_ms=1000, join_timeout_ms=3000)


def ft_argv(replica_id: int, group_size: int, folder: str, *extra: str) -> list[str]:
    return [
        *extra,
        "--fault_tolerance.enable",
        "--fault_tolerance.group_size",
        str(group_size),
        "--fault_tolerance.replica_id",
        str(replica_id),
        "--job.dump_folder",
        folder,
    ]


def ft_train_job(rank: int, world_size: int, argv: list[str], lighthouse: str, builders: Any = None) -> Any:
    """A pool job: one rank of a replica group (the lighthouse's address as a launch gets it, in its env)."""
    os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse
    return train_job(rank, world_size, argv, builders=builders)


class FtJob:
    """A lighthouse and ``groups`` replica groups of ``ranks`` ranks; everything is stopped on exit."""

    def __init__(self, groups: int, ranks: int, *, min_replicas: int, **lighthouse: int):
        self.process, self.address = start_lighthouse(min_replicas, **{**LIGHTHOUSE, **lighthouse})
        self.pools = [WorkerPool(ranks) for _ in range(groups)]
        self.threads = ThreadPoolExecutor(groups)

    def __enter__(self) -> FtJob:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.pools:
            p.kill()
        self.threads.shutdown(wait=False)
        self.stop_lighthouse()

    def stop_lighthouse(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def start(self, group: int, argv: list[str], builders: Any = None, timeout_s: float = 300) -> Future:
        """Group ``group`` runs ``argv``; the future gives each rank's ``JobFailed`` or None (or raises
        ``PoolBroken`` if a rank died)."""
        pool = self.pools[group]
        if not pool.alive():
            pool.kill()
            pool = self.pools[group] = WorkerPool(pool.world_size)
        return self.threads.submit(
            pool.run, ft_train_job, argv, self.address, builders, timeout_s=timeout_s, name=f"ft group {group}"
        )

    def run(self, argvs: list[list[str]]) -> list[list[JobFailed | None]]:
        """Every group its argv, all at once; their results."""
        futures = [self.start(g, argv) for g, argv in enumerate(argvs)]
        return [f.result() for f in futures]


def errors(results: list[JobFailed | None]) -> list[str]:
    return [r.error for r in results if r is not None]


def metrics(folder: str) -> list[dict]:
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def log(folder: str, rank: int = 0) -> str:
    with open(os.path.join(folder, f"rank{rank}.log")) as f:
        return f.read()


__all__ = ["FtJob", "PoolBroken", "errors", "ft_argv", "log", "metrics"]
