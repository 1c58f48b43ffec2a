"""Tensor parallel for LoRA linears: each adapter sharded to match its base linear's plan.

Column-parallel base (W: Shard(0) over out): A (rank, in) replicated, B (out, rank) Shard(0), so the
update comes out sharded over ``out`` like the base output and adds to it locally. Row-parallel base
(W: Shard(1) over in, input Shard(-1)): A Shard(1) over in, B replicated; A's output is then a Partial sum,
B keeps it Partial, and the base's and the update's partial sums are reduced together by the style's one
reduce-scatter (or all-reduce). No extra collective in forward; the adapters' gradients come out as DTensor
autograd makes them (a replicated adapter's Partial gradient is summed like the norms', grad_norm.py).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def _distribute(module: nn.Module, mesh: DeviceMesh, placement: Placement, src_data_rank: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class LoRAColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a LoRALinear: base W and bias Shard(0), lora_a replicated, lora_b Shard(0)."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        placement = {"": Shard(0), "lora_a": Replicate(), "lora_b": Shard(0)}.get(name)
        if placement is not None:  # "lora_dropout" has no parameters
            _distribute(module, device_mesh, placement, self.src_data_rank)


class LoRARowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a LoRALinear: base W Shard(1) (bias replicated), lora_a Shard(1), lora_b replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name == "":
            super()._partition_linear_fn(name, module, device_mesh)
        elif name in ("lora_a", "lora_b"):
            _distribute(module, device_mesh, Shard(1) if name == "lora_a" else Replicate(), self.src_data_rank)


def twin_style(style: ParallelStyle) -> ParallelStyle:
    """A plain Colwise/Rowwise style's LoRA twin (same layouts and options; the adapters sharded alike). Other
    styles (float8's, async TP's) on a LoRALinear are refused before launch."""
    twin = {ColwiseParallel: LoRAColwiseParallel, RowwiseParallel: LoRARowwiseParallel}.get(type(style))
    assert twin is not None, f"no LoRA twin of {type(style).__name__} (refused before launch)"
    new = twin.__new__(twin)
    new.__dict__.update(style.__dict__)  # the same input/output layouts and options
    return new
