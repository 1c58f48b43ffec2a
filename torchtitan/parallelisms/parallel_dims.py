"""Parallel degrees -> a DeviceMesh with named axes.

Axis order, outermost first: pp, dp_replicate, dp_shard, cp, tp. TP is innermost so its heavy,
per-layer collectives stay within the fastest links (one node); PP is outermost because it only
sends activations between neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.config_manager import JobConfig


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    enable_loss_parallel: bool

    @classmethod
    def from_config(cls, config: JobConfig, world_size: int) -> ParallelDims:
        t = config.training
        return cls(
            dp_replicate=t.data_parallel_replicate_degree,
            dp_shard=t.data_parallel_shard_degree,
            cp=config.experimental.context_parallel_degree,
            tp=t.tensor_parallel_degree,
            pp=config.experimental.pipeline_parallel_degree,
            world_size=world_size,
            enable_loss_parallel=config.loss_parallel,
        )

    def __post_init__(self) -> None:
        from torchtitan.config_manager import ConfigError

        for name in ("dp_replicate", "cp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} degree must be >= 1, got {getattr(self, name)}")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"{self._degrees('-1')}: the other degrees multiply to {others}, which does not divide "
                    f"world_size({self.world_size}); change them or the number of processes"
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        elif self.dp_shard < 1:
            raise ConfigError(f"training.data_parallel_shard_degree must be -1 or >= 1, got {self.dp_shard}")
        if others * self.dp_shard != self.world_size:
            raise ConfigError(
                f"{self._degrees(str(self.dp_shard))} = {others * self.dp_shard} != world_size({self.world_size}); "
                "set data_parallel_shard_degree = -1 to infer it"
            )

    def _degrees(self, dp_shard: str) -> str:
        return (
            f"dp_replicate({self.dp_replicate}) * dp_shard({dp_shard}) * cp({self.cp}) * tp({self.tp}) * "
            f"pp({self.pp})"
        )

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The world mesh with an axis per degree > 1, plus flattened axes; None on one process.

        Flattened axes: "dp" (dp_replicate x dp_shard) indexes the data; "dp_shard_cp" is the FSDP
        axis (CP ranks hold different tokens, so they reduce gradients like data-parallel ranks);
        "dp_cp" is the axis a loss is averaged over.
        """
        from torch.distributed.device_mesh import init_device_mesh

        dims = [(d, n) for d, n in self._axes() if d > 1]
        if not dims:
            return None
        mesh = init_device_mesh(device_type, [d for d, _ in dims], mesh_dim_names=[n for _, n in dims])
        names = [n for _, n in dims]
        for flat, parts in (
            ("dp", ("dp_replicate", "dp_shard")),
            ("dp_shard_cp", ("dp_shard", "cp")),
            ("dp_cp", ("dp_replicate", "dp_shard", "cp")),
        ):
            present = [p for p in parts if p in names]
            if len(present) > 1:
                mesh[tuple(present)]._flatten(mesh_dim_name=flat)
        return mesh

    def _axes(self) -> list[tuple[int, str]]:
        return [
            (self.pp, "pp"),
            (self.dp_replicate, "dp_replicate"),
            (self.dp_shard, "dp_shard"),
            (self.cp, "cp"),
            (self.tp, "tp"),
        ]

    def axis_name(self, flat: str) -> str | None:
        """The mesh axis to use for a (possibly flattened) group, or None if it has one rank."""
        parts = {
            "dp": ("dp_replicate", "dp_shard"),
            "dp_shard_cp": ("dp_shard", "cp"),
            "dp_cp": ("dp_replicate", "dp_shard", "cp"),
        }.get(flat, (flat,))
        present = [p for p in parts if getattr(self, p) > 1]
        if not present:
            return None
        return present[0] if len(present) == 1 else flat

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
