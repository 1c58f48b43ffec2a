"""Ring attention's communication primitives over a CP process group (the math is elsewhere)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan.distributed.backend.c10d_compat import all_gather_single


def _ring_shift(tensor: torch.Tensor, group: dist.ProcessGroup, tag: int) -> tuple[torch.Tensor, list]:
    """Post: send ``tensor`` to the next rank, receive the previous rank's into a new buffer."""
    rank, size = group.rank(), group.size()
    recv = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % size), group, tag),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % size), group, tag),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(...) -> (cp, ...): every rank's tensor, in group-rank order."""
    out = torch.empty((group.size() * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    all_gather_single(out, tensor.contiguous(), group=group)
    return out.unflatten(0, (group.size(), tensor.shape[0]))
