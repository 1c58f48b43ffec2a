"""The async TP ring's point-to-point plumbing: a ring all-gather and a ring reduce-scatter over
the TP group (``dist.batch_isend_irecv``), each step's transfer in flight while a caller's compute
runs. The math (which matmul runs on which chunk) is ``async_tp``'s.

Instrumentation: ``with record_events() as events:`` collects ``(kind, step)`` tuples in program
order: ``("all_gather", tp)`` / ``("reduce_scatter", tp)`` when a ring starts, then per step
``("comm_issued", s)``, ``("mm_start", s)``, ``("mm_end", s)``, ``("comm_waited", s)``, where a
comm is labelled with the step whose matmul it overlaps. Off by default; then each record is one
``None`` check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Ring", "record_events", "ring_all_gather", "ring_reduce_scatter"]

_events: list[tuple[str, int]] | None = None  # the active recorder's list; None = recording off


@contextlib.contextmanager
def record_events() -> Iterator[list[tuple[str, int]]]:
    """Record the ring schedule's ``(kind, step)`` events of this process while the block runs."""
    global _events
    previous, events = _events, []
    _events = events
    try:
        yield events
    finally:
        _events = previous


def _record(kind: str, step: int) -> None:
    if _events is not None:
        _events.append((kind, step))


class Ring:
    """This rank's neighbours in the TP group, ordered by group rank."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # P2POp takes global ranks; the TP group is usually a strided subset of the world.
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, send: Tensor, recv: Tensor, step: int) -> tuple[list, Tensor]:
        """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one."""
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, self.next, self.group),
                dist.P2POp(dist.irecv, recv, self.prev, self.group),
            ]
        )
        _record("comm_issued", step)
        return works, send  # the caller keeps ``send`` alive until the wait

    @staticmethod
    def wait(pending: tuple[list, Tensor], step: int) -> None:
        for work in pending[0]:
            work.wait()
        _record("comm_waited", step)


def ring_all_gather(ring: Ring, local: Tensor, compute: Callable[[int, Tensor], None]) -> list[Tensor]:
    """All-gather ``local`` chunks; ``compute(c, chunk_c)`` runs while the next chunk is in flight.

    Returns the chunks indexed by the group rank that owns them.
    """
    _record("all_gather", ring.size)
    chunks: list[Tensor | None] = [None] * ring.size
    current, owner = local.contiguous(), ring.rank
    for step in range(ring.size):
        chunks[owner] = current
        pending, incoming = None, None
        if step < ring.size - 1:
            incoming = torch.empty_like(current)
            pending = ring.shift(current, incoming, step)
        _record("mm_start", step)
        compute(owner, current)
        _record("mm_end", step)
        if pending is not None:
            ring.wait(pending, step)
            current, owner = incoming, (owner - 1) % ring.size
    return chunks  # type: ignore[return-value]


def ring_reduce_scatter(ring: Ring, partial_for: Callable[[int], Tensor]) -> Tensor:
    """Sum over ranks of ``partial_for(c)`` for ``c`` = this rank's chunk.

    ``partial_for`` must return a fresh contiguous tensor (it is summed into in place and sent).
    The partial of the next destination is computed while the running sum of the previous one
    moves one hop along the ring.
    """
    _record("reduce_scatter", ring.size)
    pending, incoming = None, None
    for step in range(ring.size):
        dest = (ring.rank - step - 1) % ring.size  # the last step (dest == rank) keeps the sum
        _record("mm_start", step)
        total = partial_for(dest)
        _record("mm_end", step)
        if pending is not None:
            ring.wait(pending, step)
            total.add_(incoming)
        if step == ring.size - 1:
            return total
        incoming = torch.empty_like(total)
        pending = ring.shift(total, incoming, step + 1)
    raise AssertionError("unreachable: the ring has at least one step")
