"""Stragglers named: which rank the others wait for (``metrics.straggler_factor``; docs/reliability.md).

What each rank measures, per step, averaged over the log window (the trainer's own clocks):

* ``data_s``: fetching the step's micro-batches (host time, the data loader's);
* ``wait_s``: blocked in the step's closing all-reduce (the step guard's, ``StepGuard.check``), entered after
  the device has finished this rank's queued work, so it is the time this rank waits for the slowest one;
* ``busy_s``: the step time less ``wait_s``: this rank's own work (data, forward, backward, clipping) *and*
  its waits inside the step's other collectives (FSDP's all-gathers, TP's, pipeline sends).

A rank slowed after its last in-step collective (its optimizer, host work, a slow device in a layout with no
collective inside forward/backward) shows in ``busy_s``; one whose input is slow shows in ``data_s``, also
where FSDP makes the others wait for it inside forward (their ``busy_s`` then grows as much as its own). So a
rank's *excess* is the larger of its ``busy_s`` and its ``data_s`` over the median of the other ranks', and a
rank is slow in a log step when its excess is at least ``(factor - 1)`` times the others' median ``busy_s``
(its step would take ``factor`` times theirs). Slow for ``log_steps`` log steps in a row: one warning line.
Every log step, one all-gather of three floats per rank over the whole world; metrics.jsonl gets the slowest
rank, its excess and the spread (1 + excess / median busy time).
"""

from __future__ import annotations

import logging
import socket
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slowest:
    rank: int
    excess_s: float
    """How much longer than the other ranks' median this rank's step is (its busy or its data time)."""
    spread: float
    """1 + excess / the other ranks' median busy time: the factor ``metrics.straggler_factor`` is compared with."""
    busy_s: float
    data_s: float
    median_busy_s: float
    median_data_s: float


def find_slowest(table: list[tuple[float, float]]) -> Slowest:
    """The rank with the largest excess over the others' medians; ``table``: per rank (busy_s, data_s), >= 2 ranks."""
    best: Slowest | None = None
    for r, (busy, data) in enumerate(table):
        others = table[:r] + table[r + 1 :]
        med_busy = statistics.median(b for b, _ in others)
        med_data = statistics.median(d for _, d in others)
        excess = max(busy - med_busy, data - med_data, 0.0)
        spread = 1.0 + excess / med_busy if med_busy > 0 else 1.0
        if best is None or excess > best.excess_s:
            best = Slowest(r, excess, spread, busy, data, med_busy, med_data)
    assert best is not None
    return best


class StragglerWatch:
    """Gathers every rank's times at each log step and names a rank slow for ``log_steps`` log steps in a row.

    Every rank calls ``observe`` at the same log steps (it is a collective); only ``log`` ranks write the line.
    """

    def __init__(self, *, factor: float, log_steps: int, log: bool):
        self.factor, self.log_steps, self.log = factor, log_steps, log
        self.world_size = dist.get_world_size()
        hosts: list[str | None] = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname())  # once: the warning names the rank's host
        self.hosts = [str(h) for h in hosts]
        self.streak = (-1, 0)  # (rank, log steps in a row it was slow)

    def observe(self, step: int, *, busy_s: float, data_s: float, wait_s: float) -> dict[str, float | int]:
        """This rank's window means in; the log record's fields out (the same on every rank)."""
        mine = torch.tensor([busy_s, data_s, wait_s], dtype=torch.float64)  # CPU: the gloo side of the backend
        every = torch.empty(self.world_size * 3, dtype=torch.float64)
        dist.all_gather_into_tensor(every, mine)
        rows = every.view(self.world_size, 3).tolist()
        slowest = find_slowest([(b, d) for b, d, _ in rows])
        slow = slowest.spread >= self.factor
        rank, count = self.streak
        self.streak = (slowest.rank, count + 1 if rank == slowest.rank else 1) if slow else (-1, 0)
        if self.streak[1] == self.log_steps and self.log:
            self._warn(
                step, slowest, wait_s=statistics.median(w for i, (_, _, w) in enumerate(rows) if i != slowest.rank)
            )
        return {
            "slowest_rank": slowest.rank,
            "slowest_excess_s": slowest.excess_s,
            "rank_time_spread": slowest.spread,
        }

    def _warn(self, step: int, s: Slowest, *, wait_s: float) -> None:
        logger.warning(
            "straggler: rank %d (host %s) is %.2fx the median of the other ranks for %d log steps in a row (to step "
            "%d): %.3f s a step busy, %.3f s fetching data, against their %.3f s and %.3f s; they wait %.3f s a "
            "step for it (metrics.straggler_factor = %g)",
            s.rank,
            self.hosts[s.rank],
            s.spread,
            self.log_steps,
            step,
            s.busy_s,
            s.data_s,
            s.median_busy_s,
            s.median_data_s,
            wait_s,
            self.factor,
        )


def build_straggler_watch(metrics, *, log: bool) -> StragglerWatch | None:
    """The run's watch (every rank's times gathered at each log step), or None: off, or a single process."""
    if metrics.straggler_factor > 0 and dist.is_initialized() and dist.get_world_size() > 1:
        return StragglerWatch(factor=metrics.straggler_factor, log_steps=metrics.straggler_log_steps, log=log)
    return None
