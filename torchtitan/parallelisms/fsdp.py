"""Data parallelism: FSDP2 (fully_shard; HSDP on a 2-D mesh) or DDP (composable replicate)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: Literal["default", "always", "never"] = "default",
    prefetch_depth: int = 1,
    cpu_offload: bool = False,
    pin_memory: bool = False,
) -> None:
    """Shard each block, then the root (embedding, norm, output), over ``dp_mesh``.

    A 1-D mesh gives FSDP; a 2-D (dp_replicate, dp_shard) mesh gives HSDP: parameters are
    sharded along the second axis and replicated along the first.

    reshard_after_forward: "always" frees every block's gathered parameters after its forward
    (backward gathers them again); "never" keeps them until backward (one all-gather per block
    per step less, at the cost of holding the whole unsharded model); "default" is "always"
    except for the last block, whose parameters backward needs at once.
    prefetch_depth: how many blocks ahead FSDP all-gathers while the current block computes
    (forward: the next blocks; backward: the previous ones). 1 is FSDP's own implicit prefetch.
    cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory; the
    optimizer step runs on the CPU.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = {"offload_policy": CPUOffloadPolicy(pin_memory=pin_memory)} if cpu_offload else {}
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        reshard = reshard_after_forward == "always" or (reshard_after_forward == "default" and not last)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard, **offload)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward != "never", **offload)
    if prefetch_depth > 1:
        _set_explicit_prefetch(blocks, prefetch_depth)


def _set_explicit_prefetch(blocks: list[nn.Module], depth: int) -> None:
    """Block i all-gathers blocks i+1..i+depth before its forward and i-1..i-depth before its backward."""
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + depth])
        block.set_modules_to_backward_prefetch(list(reversed(blocks[max(0, i - depth) : i])))


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Replicate parameters; gradients are all-reduced (averaged) in buckets during backward."""
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)
