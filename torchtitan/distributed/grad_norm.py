"""Gradient-norm clipping for any mix of plain and DTensor gradients, with one all-reduce.

Each rank sums the p-th powers of its *local* gradient shards. A shard replicated over some mesh
axes exists on every rank of those axes, so its contribution is divided by their size: summing
over the whole mesh then counts every parameter exactly once. One all-reduce over the (flattened)
mesh gives the total, whatever mix of FSDP/HSDP/TP placements the parameters have; then every
gradient is scaled locally. (DTensor's own norm reduction would do one all-reduce per mesh axis.)
Plain-tensor gradients (one process, or DDP, where they are already identical) need no reduction.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate


def _mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group spanning every axis of ``mesh`` (flattened once, cached on the mesh).

    Cached on the mesh object itself: a module-level cache keyed by ``id(mesh)`` handed a later
    mesh (same id after garbage collection) the group of an earlier one, possibly destroyed.
    """
    if mesh.ndim == 1:
        return mesh.get_group()
    group = getattr(mesh, "_torchtitan_norm_group", None)
    if group is None:
        group = mesh._flatten("_".join(mesh.mesh_dim_names) + "_norm").get_group()
        mesh._torchtitan_norm_group = group
    return group


def _replication(g: DTensor) -> int:
    assert not any(pl.is_partial() for pl in g.placements), "gradients must be reduced before clipping"
    return math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())


def _partial_norms(grads: list[torch.Tensor], norm_type: float) -> dict[DeviceMesh | None, torch.Tensor]:
    """Per mesh (None = plain tensors): the local sum of |g|^p, or max |g| for the inf-norm."""
    inf_norm = math.isinf(norm_type)
    buckets: dict[DeviceMesh | None, tuple[list[torch.Tensor], list[float]]] = {}
    for g in grads:
        mesh = g.device_mesh if isinstance(g, DTensor) else None
        local, weight = (g.to_local(), 1.0 / _replication(g)) if mesh is not None else (g, 1.0)
        buckets.setdefault(mesh, ([], []))[0].append(local)
        buckets[mesh][1].append(weight)
    out = {}
    for mesh, (locals_, weights) in buckets.items():
        # bf16 gradients (training.dtype): each norm accumulated and returned in fp32, not rounded to 8 bits
        wide = {"dtype": torch.float32} if any(t.dtype != torch.float32 for t in locals_) else {}
        norms = torch.stack(torch._foreach_norm(locals_, norm_type, **wide)).float()
        if inf_norm:
            out[mesh] = norms.max()
        else:
            out[mesh] = (norms.pow(norm_type) * torch.tensor(weights, device=norms.device)).sum()
    return out


@torch.no_grad()
def reduce_partial_grads_(parameters: Iterable[torch.nn.Parameter]) -> None:
    """Finish gradients that DTensor left as pending sums (``Partial``), in one all-reduce per layout.

    Under sequence parallel, a replicated weight applied to sequence-sharded activations (the
    norms) gets a per-rank partial gradient. Reducing them here, batched, before clipping and the
    optimizer means both see final values and the optimizer does not reduce them again one by one.
    """
    buckets: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in parameters:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            buckets.setdefault((g.device_mesh, g.placements), []).append(p)
    for (mesh, placements), params in buckets.items():
        flat = torch.cat([p.grad.to_local().reshape(-1) for p in params])
        for axis, pl in enumerate(placements):
            if pl.is_partial():
                assert pl.reduce_op == "sum", f"unexpected partial reduction {pl}"
                dist.all_reduce(flat, group=mesh.get_group(axis))
        done = tuple(Replicate() if pl.is_partial() else pl for pl in placements)
        for p, chunk in zip(params, flat.split([p.grad.to_local().numel() for p in params])):
            local = chunk.view_as(p.grad.to_local())
            p.grad = DTensor.from_local(local, mesh, done, run_check=False, shape=p.grad.shape, stride=p.grad.stride())


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    extra_groups: Iterable[dist.ProcessGroup] = (),
) -> torch.Tensor:
    """Clip gradients in place to total norm ``max_norm``; return the total norm (before clipping).

    ``max_norm <= 0``: no clipping (torchtitan's meaning of 0); the norm is still computed, for the
    metrics and the non-finite guard.

    ``extra_groups``: process groups whose ranks hold *different* parameters that are not visible
    in the DTensor placements (e.g. pipeline stages); the total is reduced over them too.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total_norm = _total_norm(_partial_norms(grads, norm_type), norm_type, extra_groups)
    if max_norm <= 0:
        return total_norm
    clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    local_grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    torch._foreach_mul_(local_grads, clip_coef.to(local_grads[0].dtype))
    return total_norm


def _total_norm(
    parts: dict[DeviceMesh | None, torch.Tensor], norm_type: float, extra_groups: Iterable[dist.ProcessGroup]
) -> torch.Tensor:
    """The global norm from per-mesh local partial sums: one all-reduce per mesh, then over ``extra_groups``."""
    inf_norm = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM
    total = None
    for mesh, part in parts.items():
        if mesh is not None:
            dist.all_reduce(part, op=op, group=_mesh_group(mesh))
        total = part if total is None else (torch.maximum(total, part) if inf_norm else total + part)
    for group in extra_groups:
        dist.all_reduce(total, op=op, group=group)
    return total if inf_norm else total.pow(1.0 / norm_type)


class GradNormAccumulator:
    """The total 2-norm of gradients that are seen one at a time and then freed (optimizer steps in backward).

    ``add`` keeps each gradient's local partial sum per mesh (the same weighting as clipping);
    ``finish`` reduces them once, as ``clip_grad_norm_`` does, and starts over.
    """

    def __init__(self) -> None:
        self.parts: dict[DeviceMesh | None, torch.Tensor] = {}

    @torch.no_grad()
    def add(self, grad: torch.Tensor) -> None:
        # Called once per parameter per step (a hook): one norm kernel, no list or weight tensor built.
        mesh = grad.device_mesh if isinstance(grad, DTensor) else None
        local = grad.to_local() if mesh is not None else grad
        part = torch.linalg.vector_norm(local).float().square()
        if mesh is not None:
            part = part / _replication(grad)
        self.parts[mesh] = part if mesh not in self.parts else self.parts[mesh] + part

    @torch.no_grad()
    def finish(self, extra_groups: Iterable[dist.ProcessGroup] = ()) -> torch.Tensor:
        parts, self.parts = self.parts, {}
        if not parts:
            return torch.tensor(0.0)
        return _total_norm(parts, 2.0, extra_groups)
