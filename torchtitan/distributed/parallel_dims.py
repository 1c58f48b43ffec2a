"""Parallel degrees -> a DeviceMesh with named axes.

Axis order, outermost first: pp, dp_replicate, dp_shard, cp, tp. TP is innermost so its heavy,
per-layer collectives stay within the fastest links (one node); PP is outermost because it only
sends activations between neighbours.

Expert parallel (ep > 1) borrows its ranks from data parallel and, when TP is on, from TP (each
TP rank routes its own sequence shard, so TP ranks hold different tokens too): dp_shard is split
into two real axes, dp_shard_mod_ep (outer) x dp_shard_in_ep (inner), and the EP group is the
flattened (dp_shard_in_ep, tp). The experts' FSDP runs over dp_shard_mod_ep (with dp_replicate:
HSDP); dense parameters still shard over the flattened "dp_shard" (x cp) as without EP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchtitan.config.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.config.manager import JobConfig
    from torchtitan.config.schema import Experimental, Training


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    enable_loss_parallel: bool
    ep: int = 1

    @classmethod
    def from_sections(cls, *, training: Training, experimental: Experimental, world_size: int) -> ParallelDims:
        """The degrees of ``[training]`` and ``[experimental]`` over ``world_size`` processes."""
        return cls(
            dp_replicate=training.data_parallel_replicate_degree,
            dp_shard=training.data_parallel_shard_degree,
            cp=experimental.context_parallel_degree,
            tp=training.tensor_parallel_degree,
            pp=experimental.pipeline_parallel_degree,
            world_size=world_size,
            enable_loss_parallel=training.enable_loss_parallel,
            ep=experimental.expert_parallel_degree,
        )

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
            # The config's bounds (config/bounds.py) refuse these first, naming the key.
            assert getattr(self, name) >= 1, f"{name} degree must be >= 1, got {getattr(self, name)}"
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"{self._formula('-1')}: the other degrees multiply to {others}, which does not divide "
                    f"world_size({self.world_size}); change them or the number of processes"
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        elif self.dp_shard < 1:
            raise ConfigError(f"training.data_parallel_shard_degree must be -1 or >= 1, got {self.dp_shard}")
        if others * self.dp_shard != self.world_size:
            raise ConfigError(
                f"{self._formula(str(self.dp_shard))} = {others * self.dp_shard} != world_size({self.world_size}); "
                "set data_parallel_shard_degree = -1 to infer it"
            )
        self._check_ep()

    def _check_ep(self) -> None:
        """EP = dp_shard_in_ep x tp: it must contain the TP group and take a divisor of dp_shard."""
        if self.ep == 1:
            return
        key = f"experimental.expert_parallel_degree = {self.ep}"
        if self.tp > 1 and self.ep % self.tp:
            raise ConfigError(
                f"{key} is not a multiple of training.tensor_parallel_degree = {self.tp}: the EP group contains "
                f"the TP group (TP ranks route different tokens); use an EP degree of tp x k with k dividing "
                f"data_parallel_shard_degree ({self.dp_shard})"
            )
        if self.dp_shard % self.ep_in_dp:
            raise ConfigError(
                f"{key}{f' / tensor_parallel_degree {self.tp}' if self.tp > 1 else ''} = {self.ep_in_dp} does not "
                f"divide data_parallel_shard_degree = {self.dp_shard}: EP borrows its ranks from the sharded "
                f"data-parallel axis; choose an EP degree (tp x k) whose k divides {self.dp_shard}"
            )

    def _formula(self, dp_shard: str) -> str:
        return (
            f"dp_replicate({self.dp_replicate}) * dp_shard({dp_shard}) * cp({self.cp}) * tp({self.tp}) * pp({self.pp})"
        )

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The world mesh with an axis per degree > 1, plus flattened axes; None on one process.

        Flattened axes: "dp" (dp_replicate x dp_shard) indexes the data; "dp_shard_cp" is the FSDP
        axis (CP ranks hold different tokens, so they reduce gradients like data-parallel ranks);
        "dp_cp" is the axis a loss is averaged over.
        Under EP also "dp_shard" (dp_shard_mod_ep x dp_shard_in_ep, the dense FSDP axis) and "ep"
        (dp_shard_in_ep x tp); dp_shard_mod_ep is kept even at size 1 as the experts' FSDP axis.
        A flattened axis is only built from two or more axes > 1: use ``axis_name`` to address one.
        """
        from torch.distributed.device_mesh import init_device_mesh

        clear_dtensor_caches()
        dims = [(d, n) for d, n in self._axes() if d > 1 or n == "dp_shard_mod_ep"]
        if self.world_size == 1:
            return None
        mesh = init_device_mesh(device_type, [d for d, _ in dims], mesh_dim_names=[n for _, n in dims])
        names = [n for _, n in dims]
        for flat, parts in self._flat_axes().items():
            present = [p for p in parts if p in names and self.size(p) > 1]
            if len(present) > 1:
                mesh[tuple(present)]._flatten(mesh_dim_name=flat)
        return mesh

    def _axes(self) -> list[tuple[int, str]]:
        shard = [(self.dp_shard, "dp_shard")]
        if self.ep_enabled:
            shard = [(self.dp_shard // self.ep_in_dp, "dp_shard_mod_ep"), (self.ep_in_dp, "dp_shard_in_ep")]
        return [(self.pp, "pp"), (self.dp_replicate, "dp_replicate"), *shard, (self.cp, "cp"), (self.tp, "tp")]

    def _flat_axes(self) -> dict[str, tuple[str, ...]]:
        """Flattened axis -> the real axes it spans (dp_shard itself is flattened under EP)."""
        shard = ("dp_shard_mod_ep", "dp_shard_in_ep") if self.ep_enabled else ("dp_shard",)
        flat = {
            "dp": ("dp_replicate", *shard),
            "dp_shard_cp": (*shard, "cp"),
            "dp_cp": ("dp_replicate", *shard, "cp"),
        }
        if self.ep_enabled:
            flat["dp_shard"] = shard
            flat["ep"] = ("dp_shard_in_ep", "tp")
        return flat

    def degrees(self) -> dict[str, int]:
        """Axis -> degree in mesh order (pp, dp_replicate, dp_shard, cp, tp), then ep; for logs and records."""
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
            "ep": self.ep,
        }

    def size(self, axis: str) -> int:
        """The number of ranks of a real or flattened axis."""
        sizes = dict((n, d) for d, n in self._axes())
        return math.prod(sizes.get(p, 1) for p in self._flat_axes().get(axis, (axis,)))

    def axis_name(self, flat: str) -> str | None:
        """The mesh axis to use for a (possibly flattened) group, or None if it has one rank."""
        parts = self._flat_axes().get(flat, (flat,))
        present = [p for p in parts if self.size(p) > 1]
        if not present:
            return None
        return present[0] if len(present) == 1 else flat

    @property
    def ep_in_dp(self) -> int:
        """dp_shard_in_ep: the data-parallel share of the EP group (ep / tp, or ep without TP)."""
        return self.ep // self.tp if self.tp > 1 else self.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp > 1 and self.enable_loss_parallel


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions (``build_mesh`` does, for every new world).

    Cache entries hold the meshes they were computed on, and a mesh of the same shape from a
    previous (destroyed) process group compares equal, so in a process that runs more than one
    world (the estimator's simulated ranks, the test matrix's jobs in one launch) a cache hit would
    hand this world's DTensors a mesh whose groups no longer exist. Private torch 2.13 names.
    """
    import torch
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's own cache
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def check_data_parallel(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Pre-launch: the FSDP knobs without FSDP have no effect (a warning)."""
    t = config.training
    fsdp_knobs = t.enable_cpu_offload or t.fsdp_reshard_after_forward != "default" or t.fsdp_prefetch_depth != 1
    if fsdp_knobs and not dims.fsdp_enabled:
        return [
            "training.enable_cpu_offload / fsdp_reshard_after_forward / fsdp_prefetch_depth have no effect "
            "without FSDP (data_parallel_shard_degree > 1)"
        ]
    return []
