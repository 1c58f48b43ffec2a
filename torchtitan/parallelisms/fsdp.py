"""Data parallelism: FSDP2 (fully_shard; HSDP on a 2-D mesh) or DDP (composable replicate)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool = True,
) -> None:
    """Shard each block, then the root (embedding, norm, output), over ``dp_mesh``.

    A 1-D mesh gives FSDP; a 2-D (dp_replicate, dp_shard) mesh gives HSDP: parameters are
    sharded along the second axis and replicated along the first.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again as soon as backward starts: keeping them
        # unsharded after forward saves one all-gather per step.
        last = i == len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and not last)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Replicate parameters; gradients are all-reduced (averaged) in buckets during backward."""
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)
