"""Data parallelism: FSDP2 (fully_shard; HSDP on a 2-D mesh) or DDP (composable replicate)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from torchtitan.models.moe import GroupedExperts


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
    experts_mesh: DeviceMesh | None = None,
    blocks: list[nn.Module] | None = None,
) -> None:
    """Shard each block, then the root (embedding, norm, output), over ``dp_mesh``.

    A 1-D mesh gives FSDP; a 2-D (dp_replicate, dp_shard) mesh gives HSDP: parameters are
    sharded along the second axis and replicated along the first.

    reshard_after_forward: "always" frees every block's gathered parameters after its forward
    (backward gathers them again); "never" keeps them until backward (one all-gather per block
    per step less, at the cost of holding the whole unsharded model); "default" is "always"
    except for the last block and the root, whose parameters backward needs at once.
    prefetch_depth: how many blocks ahead FSDP all-gathers while the current block computes
    (forward: the next blocks; backward: the previous ones). 1 is FSDP's own implicit prefetch.
    cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory; the
    optimizer step runs on the CPU.
    experts_mesh: under expert parallel, the data-parallel ranks *outside* the EP group
    (dp_shard_mod_ep, with dp_replicate for HSDP). Each MoE's experts (DTensors sharded over the
    EP mesh) become their own FSDP unit on it, so their grads are averaged over those ranks only
    (the EP all-to-all already averaged them inside the EP group); the rest of the block shards
    over ``dp_mesh`` as usual. A size-1 experts_mesh still wraps them (it is what keeps them out
    of the block's unit, whose mesh overlaps the EP mesh).
    blocks: the units (default ``model.layers``' blocks; a transformers model's decoder layers).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = {"offload_policy": CPUOffloadPolicy(pin_memory=pin_memory)} if cpu_offload else {}
    blocks = list(model.layers.values()) if blocks is None else blocks
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        reshard = reshard_after_forward == "always" or (reshard_after_forward == "default" and not last)
        if experts_mesh is not None:
            for experts in [m for m in block.modules() if isinstance(m, GroupedExperts)]:
                fully_shard(
                    experts,
                    mesh=experts_mesh,
                    mp_policy=mp,
                    reshard_after_forward=reshard,
                    shard_placement_fn=_experts_placement(experts_mesh),
                    **offload,
                )
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard, **offload)
    # the root (embedding, norm, output): by default torch's own rule for it (None), which keeps its gathered
    # parameters from forward to backward, whose first step needs the norm and output again: one all-gather per
    # step less than resharding it (issue 85: the CPU FSDP2 step against torchtitan 2024, which resharded it)
    root = {"default": None, "always": True, "never": False}[reshard_after_forward]
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=root, **offload)
    if prefetch_depth > 1:
        _set_explicit_prefetch(blocks, prefetch_depth)


def _experts_placement(experts_mesh: DeviceMesh):
    """Shard the stacked (E_local, ., .) expert weights over experts (dim 0) when they divide evenly,
    else along dim 1 (e.g. 2 local experts over 4 FSDP ranks)."""
    shards = experts_mesh.size(experts_mesh.ndim - 1)  # the sharded (last) axis; HSDP replicates the first

    def placement(param: nn.Parameter) -> Shard:
        local = param.to_local() if hasattr(param, "to_local") else param
        return Shard(0) if local.shape[0] % shards == 0 else Shard(1)

    return placement


def _set_explicit_prefetch(blocks: list[nn.Module], depth: int) -> None:
    """Block i all-gathers blocks i+1..i+depth before its forward and i-1..i-depth before its backward."""
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + depth])
        block.set_modules_to_backward_prefetch(list(reversed(blocks[max(0, i - depth) : i])))


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Replicate parameters; gradients are all-reduced (averaged) in buckets during backward. A model with nothing to
    train (the RL loop's frozen reference) is left as it is: it has no gradients to average, and DDP refuses it."""
    from torch.distributed._composable.replicate import replicate

    if not any(p.requires_grad for p in model.parameters()):
        return

    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)
