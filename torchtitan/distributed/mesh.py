"""The world mesh and its process groups, answered in one place.

Components ask ``WorldMesh`` for "the mesh / the group of this (possibly flattened) axis, or None
when it has one rank" instead of receiving loose ``loss_group=`` / ``pp_group=`` arguments. The
axis names are ``ParallelDims``'s: pp, dp_replicate, dp_shard, cp, tp, ep and the flattened dp,
dp_shard_cp, dp_cp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.distributed.parallel_dims import ParallelDims

# Fault tolerance's replica groups sit outside the mesh (each group is its own launch): this sums a tensor in
# place over the live groups (torchft's all-reduce) and returns their number. Passed to the few reductions
# that need every group's data (block-causal token counts, the MoE expert-bias counts); each is called at the
# same point of every step on every group, between the quorum and the commit, so the groups' collectives pair.
OuterSum = Callable[[torch.Tensor], int]


@dataclass(frozen=True)
class WorldMesh:
    dims: ParallelDims
    mesh: DeviceMesh | None  # None on one process

    def get(self, axis: str) -> DeviceMesh | None:
        """The 1-D mesh of ``axis`` (real or flattened), or None if that axis has one rank."""
        name = self.dims.axis_name(axis)
        return None if name is None else self.mesh[name]

    def group(self, axis: str) -> dist.ProcessGroup | None:
        mesh = self.get(axis)
        return None if mesh is None else mesh.get_group()

    def local_rank(self, axis: str) -> int:
        """This rank's index along ``axis`` (0 when the axis has one rank)."""
        mesh = self.get(axis)
        return 0 if mesh is None else mesh.get_local_rank()


class StepMeans:
    """Logged means over a step's global batch of ``n`` quantities (multi-token prediction's per-depth losses,
    DSA's indexer term): this rank's (sum, count) of each, added as the step runs, summed on log steps over the ranks
    holding other tokens (data parallel) and the pipeline ranks (stages without the quantity add zeros)."""

    def __init__(self, n: int, world: WorldMesh, device: torch.device):
        self.world = world
        self.totals = torch.zeros(2, n, dtype=torch.float64, device=device)  # (sums, counts) this step
        self.last: list[float] | None = None

    def add(self, i: int, total: torch.Tensor, count: torch.Tensor | float) -> None:
        self.totals[0, i] += total.detach().double()
        self.totals[1, i] += count

    @torch.no_grad()
    def reduce(self, keep_metrics: bool) -> None:
        """After backward, on every rank: the step's sums (log steps only) into ``last``; the totals start over."""
        totals, self.totals = self.totals, self.totals.new_zeros(self.totals.shape)
        if not keep_metrics:
            return
        for group in (self.world.group("pp"), self.world.group("dp_cp")):
            if group is not None:
                dist.all_reduce(totals, group=group)
        if not is_fake(totals):  # the memory estimator's fake step has no values to log
            self.last = (totals[0] / totals[1].clamp(min=1)).tolist()

    def take(self) -> list[float] | None:
        """The last log step's means (taken: None until the next), or None (a dropped step, not a log step)."""
        last, self.last = self.last, None
        return last
