"""``TokenShardedReplicate``: a TP style for modules whose replicated weights act on each rank's own slice (its
tokens under sequence parallel, or its heads): the MoE's router and shared expert, the QK-norms, Gated DeltaNet's
gated norm. Its own module so the plans of plan.py and linear_attention.py both import it. And the functions that
replicate a module's own weights with plain tensors in and out (``distribute_module``'s hooks): a transformers
model's non-TP modules (parallelize.py) and an image model's tower (vision.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class TokenShardedReplicate(ParallelStyle):
    """Replicated weights applied to this rank's own tokens: (T_local, ...) plain in, plain out.

    The input is read as Shard(``shard_dim``) (default 0: tokens) of all TP ranks' inputs, so the
    weight grad is Partial(sum). Qwen3's q/k norms use dim 2: each rank's own heads.
    """

    def __init__(self, shard_dim: int = 0):
        super().__init__()
        self.shard_dim = shard_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for param_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def to_dtensor(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(x, mesh, [Shard(self.shard_dim)], run_check=False) for x in inputs)

        def to_local(mod: nn.Module, out: DTensor, mesh: DeviceMesh):
            return out.to_local()

        return distribute_module(module, device_mesh, replicate, input_fn=to_dtensor, output_fn=to_local)


def replicate_own(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """``distribute_module``'s partition_fn: the module's own parameters and buffers as Replicate DTensors."""
    for key, p in list(module.named_parameters(recurse=False)):
        if not isinstance(p, DTensor):
            module.register_parameter(key, nn.Parameter(distribute_tensor(p, mesh, [Replicate()]), p.requires_grad))
    for key, b in list(module.named_buffers(recurse=False)):
        if not isinstance(b, DTensor):
            module.register_buffer(
                key, distribute_tensor(b, mesh, [Replicate()]), key not in module._non_persistent_buffers_set
            )


def inputs_replicated(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """``distribute_module``'s input_fn: plain tensors in, read as Replicate (the same on every rank)."""
    return tuple(
        DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
        else t
        for t in inputs
    )


def outputs_local(module: nn.Module, outputs, mesh: DeviceMesh):
    """``distribute_module``'s output_fn: plain tensors out."""
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs
