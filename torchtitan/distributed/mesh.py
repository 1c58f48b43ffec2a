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

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.distributed.parallel_dims import ParallelDims

# Fault tolerance's replica groups sit outside the mesh (each group is its own launch): this sums a tensor in
# place over the live groups (torchft's all-reduce) and returns their number. Passed to the few reductions
# that need every group's data (block-causal token counts, the MoE expert-bias counts); each is called at the
# same point of every step on every group, between the quorum and the commit, so the groups' collectives pair.
OuterSum = Callable[["torch.Tensor"], int]


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
