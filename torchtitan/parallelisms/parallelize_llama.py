"""The one composition of parallelisms for the llama family."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchtitan.parallelisms.activation_checkpoint import apply_ac
from torchtitan.parallelisms.fsdp import apply_ddp, apply_fsdp, to_dtype
from torchtitan.parallelisms.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.config_manager import JobConfig


def apply_compile(model: nn.Module) -> None:
    """Compile each block separately: blocks are identical, so one compiled graph is reused by all."""
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)


def parallelize_llama(model: nn.Module, world_mesh: DeviceMesh | None, parallel_dims: ParallelDims, config: JobConfig) -> None:
    """Apply, in place and in this order: activation checkpointing, compile, then FSDP/HSDP or DDP.

    Why this order: AC wraps each block before compile so the compiled graph contains the
    recomputation policy; compile comes before FSDP so FSDP's hooks stay outside the compiled
    region (its communication is not traced). Data parallelism is last because it wraps whatever
    module structure the earlier steps produced, and its unit is the (wrapped, compiled) block.
    """
    apply_ac(model, config.activation_checkpoint)
    if config.training.compile:
        apply_compile(model)
    if parallel_dims.fsdp_enabled:
        shard_axis = parallel_dims.axis_name("dp_shard_cp")
        dims = ("dp_replicate", shard_axis) if parallel_dims.dp_replicate_enabled else (shard_axis,)
        apply_fsdp(
            model,
            world_mesh[dims],
            param_dtype=to_dtype(config.training.mixed_precision_param),
            reduce_dtype=to_dtype(config.training.mixed_precision_reduce),
        )
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, world_mesh["dp_replicate"])
