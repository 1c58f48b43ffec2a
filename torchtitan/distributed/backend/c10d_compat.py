"""The c10d names that changed between torch releases: the one seam for them.

Collectives: torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (the old names remain as deprecated aliases that warn); torch 2.11 has only the old
names. FSDP2 calls whichever its torch has, so the estimator, which wraps FSDP's collectives, patches
``torch.distributed`` by the names below; our own calls go through the functions here, which look the name up
at call time so such a patch sees them too.

Timeouts: torch 2.14 added a public ``set_timeout`` and deprecated the private ``_set_pg_timeout`` (with a
FutureWarning), which is all 2.11 to 2.13 have.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
):
    """``dist.all_gather_single`` (``all_gather_into_tensor`` before torch 2.13): every rank's ``input``, concatenated."""
    return getattr(dist, ALL_GATHER)(output, input, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
):
    """``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` before torch 2.13): this rank's chunk of the sum."""
    return getattr(dist, REDUCE_SCATTER)(output, input, op=op, group=group, async_op=async_op)


def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    """``dist.set_timeout`` where torch has it, else ``_set_pg_timeout``: the timeout of later collectives."""
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(timeout, group)
    else:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timeout, group)
