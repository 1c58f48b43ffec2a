"""Tensor parallel for Gated DeltaNet (Qwen3.5's linear-attention layer, models/qwen3_5/gated_delta.py).

Sharded by heads, as attention is: the fused q/k/v projection column-parallel (its rows are grouped by key head
in our layout, so each rank's contiguous rows are whole groups: its key heads and the value heads they serve),
``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` column-parallel over value heads, the depthwise convolution's
channels and the per-head ``A_log`` / ``dt_bias`` sharded the same way (Shard(0); the layer reads its local part),
the gated norm (one weight shared by every head) replicated over this rank's heads, ``out_proj`` row-parallel.
Each rank runs the recurrence of its own heads: the state never crosses ranks, and no collective is added beyond
the row-parallel output's.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from torchtitan.distributed.tensor_parallel.replicated import TokenShardedReplicate

_COLUMNS = ("attention.in_proj_qkv", "attention.in_proj_z", "attention.in_proj_b", "attention.in_proj_a")


def is_gated_delta(attention: nn.Module) -> bool:
    return getattr(attention, "in_proj_qkv", None) is not None


def gated_delta_plan(sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
    """The mixer's styles (the block's ``attention`` input is prepared by the block plan); without sequence
    parallel (generation) ``out_proj`` returns the replicated sum."""
    out = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    return {
        **{name: ColwiseParallel() for name in _COLUMNS},
        "attention.norm": TokenShardedReplicate(2),  # (bs, seqlen, local heads, value dim)
        "attention.out_proj": out,
    }


def shard_gated_delta_heads(attention: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The convolution's channels and ``A_log`` / ``dt_bias`` (one per value head) sharded like the projections
    that feed them: Shard(0)."""
    owners = ((attention.conv1d, "weight"), (attention, "A_log"), (attention, "dt_bias"))
    for module, name in owners:
        param = getattr(module, name)
        if not isinstance(param, DTensor):
            sharded = nn.Parameter(distribute_tensor(param.data, tp_mesh, [Shard(0)]), param.requires_grad)
            module.register_parameter(name, sharded)
