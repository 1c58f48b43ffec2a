"""Gradient-norm clipping for any mix of plain and DTensor gradients.

The total norm is computed from local shards and reduced *once* per group of parameters that
share a mesh and sharding axes: a partial sum of squares (or max, for the inf-norm) is
all-reduced over exactly the axes that shard those parameters, never over axes that replicate
them (which would count a parameter more than once). Then every gradient is scaled locally.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _group_local_grads(parameters: Iterable[torch.nn.Parameter]) -> dict[tuple | None, list[torch.Tensor]]:
    """Local gradient tensors keyed by (mesh, sharded axes); None for unsharded ones."""
    groups: dict[tuple | None, list[torch.Tensor]] = {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        key = None
        if isinstance(g, DTensor):
            assert not any(pl.is_partial() for pl in g.placements), "gradients must be reduced before clipping"
            axes = tuple(i for i, pl in enumerate(g.placements) if pl.is_shard())
            key = (g.device_mesh, axes) if axes else None
            g = g.to_local()
        groups.setdefault(key, []).append(g)
    return groups


def _reduce_partial(part: torch.Tensor, key: tuple | None, inf_norm: bool) -> torch.Tensor:
    if key is None:
        return part
    mesh, axes = key
    op = dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM
    for axis in axes:
        dist.all_reduce(part, op=op, group=mesh.get_group(axis))
    return part


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    extra_groups: Iterable[dist.ProcessGroup] = (),
) -> torch.Tensor:
    """Clip gradients in place to total norm ``max_norm``; return the total norm (before clipping).

    ``extra_groups``: process groups whose ranks hold *different* parameters (e.g. pipeline
    stages); the total norm is reduced over them as well.
    """
    inf_norm = math.isinf(norm_type)
    groups = _group_local_grads(parameters)
    all_grads = [g for gs in groups.values() for g in gs]
    if not all_grads:
        return torch.tensor(0.0)
    total = torch.zeros((), dtype=torch.float32, device=all_grads[0].device)
    for key, grads in groups.items():
        norms = torch.stack(torch._foreach_norm(grads, norm_type)).float()
        part = norms.max() if inf_norm else norms.pow(norm_type).sum()
        part = _reduce_partial(part, key, inf_norm)
        total = torch.maximum(total, part) if inf_norm else total + part
    for group in extra_groups:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM, group=group)
    total_norm = total if inf_norm else total.pow(1.0 / norm_type)
    clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(all_grads, clip_coef.to(all_grads[0].dtype))
    return total_norm
