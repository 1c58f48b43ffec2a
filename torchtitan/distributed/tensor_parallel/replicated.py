"""``TokenShardedReplicate``: a TP style for modules whose replicated weights act on each rank's own slice (its
tokens under sequence parallel, or its heads): the MoE's router and shared expert, the QK-norms, Gated DeltaNet's
gated norm. Its own module so the plans of plan.py and linear_attention.py both import it.
"""

from __future__ import annotations

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
