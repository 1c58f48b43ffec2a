"""Expert parallel: each rank of the EP mesh owns num_experts / ep of every MoE layer's experts.

``parallelize_module(moe.experts, ep_mesh, ExpertParallel())`` shards the stacked expert weights
``Shard(0)`` (over experts) and wraps ``GroupedExperts.forward`` with a token dispatch and combine:

1. dispatch: an all-to-all of the per-expert token counts, then an all-to-all (autograd-aware,
   uneven splits, zero rows allowed) of the tokens, which arrive ordered (source rank, local
   expert); a permute reorders them to (local expert, source rank) for the grouped matmul;
2. the local experts run on the tokens they received;
3. combine: the inverse permute, then the reverse all-to-all back to the tokens' own ranks.

Each EP rank holds *different* tokens (EP ranks are data-parallel ranks), and the router, shared
expert, attention etc. stay replicated across them.

Gradient contract (what makes EP match one process on the global batch): let the global loss be
the mean over the global batch and let every data-parallel rank, EP ranks included, compute the
mean loss over its own (equal-sized) slice, as plain data parallel does. Then
* non-expert parameters: reduce their grads with AVG over all data-parallel ranks (unchanged DP);
* expert parameters: the tokens' all-to-all backward *sums* every EP rank's contribution into the
  owning rank; this style scales that by 1 / ep (in the combine's backward, and undoes the scale on
  the token gradients in the dispatch's backward), so an expert grad is already the AVG over the
  EP ranks. When EP borrows its ranks from the data-parallel axis (dp = ep * dp_rest), reduce
  expert grads with AVG over the remaining dp_rest ranks only (FSDP's default over that mesh).
  Both results equal the single-process gradient of the global-mean loss.
If local batches differ in size, scale each rank's local loss so that the AVG over dp ranks is
the global loss (local loss = dp * sum of own token losses / global token count).

With tensor (sequence) parallel inside the EP group (ep = dp_in_ep * tp, see parallel_dims.py)
the tp ranks of one data-parallel rank each route their own sequence shard but share one loss,
the mean over the whole dp-rank batch; their tokens' grads are therefore already 1/tp of an
own-slice mean, and the scale becomes tp / ep = 1 / dp_in_ep (``ExpertParallel(tp=tp)``): the
expert grad is then the AVG over the dp_in_ep data-parallel ranks of the EP group.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from torchtitan.models.moe.moe import GroupedExperts, balanced_split


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ExpertParallel(ParallelStyle):
    """Shard a ``GroupedExperts`` over a 1-D EP mesh and route its tokens with all-to-alls.

    The wrapped module is called as ``experts(x, num_tokens_per_expert)`` with this rank's routed
    tokens x (T, dim) sorted by *global* expert and counts (num_experts,); it returns (T, dim) in
    the same order. Inside, the module sees only the tokens for its num_experts / ep local experts.
    """

    def __init__(self, *, tp: int = 1) -> None:
        super().__init__()
        self.tp = tp  # EP ranks per data-parallel rank that share one loss (see the module docstring)
        # Set by the dispatch, read by the combine of the same forward call.
        self._input_splits: list[int] = []
        self._output_splits: list[int] = []
        self._permutation: torch.Tensor | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise NotImplementedError(f"ExpertParallel needs a 1-D EP mesh, got {device_mesh.ndim}-D {device_mesh}")
        ep, num_experts = device_mesh.size(), module.num_experts
        if ep % self.tp:
            raise ValueError(f"ExpertParallel(tp={self.tp}) over an EP mesh of {ep} ranks: ep must be a multiple of tp")
        if num_experts % ep:
            raise ValueError(
                f"num_experts = {num_experts} is not divisible by the expert parallel degree {ep}: each EP "
                "rank owns an equal share of the experts; choose an EP degree that divides num_experts"
            )
        return distribute_module(
            module, device_mesh, partition_fn=_shard_experts, input_fn=self._dispatch, output_fn=self._combine
        )

    def _dispatch(self, module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        if module.balanced_routing:
            return self._dispatch_balanced(inputs, device_mesh)
        x, counts = inputs  # (T, dim) sorted by global expert; (E,)
        ep, group = device_mesh.size(), device_mesh.get_group()
        local_experts = counts.numel() // ep
        # Counts of every (source rank, local expert) pair this rank will receive.
        counts_recv = funcol.all_to_all_single(counts.long(), None, None, group)  # (ep * E_local,)
        counts_recv = funcol.wait_tensor(counts_recv).view(ep, local_experts)  # (ep, E_local)
        self._input_splits = counts.long().view(ep, local_experts).sum(dim=1).tolist()
        self._output_splits = counts_recv.sum(dim=1).tolist()
        recv = funcol.all_to_all_single_autograd(x, self._output_splits, self._input_splits, group)  # (T_recv, dim)
        # The combine scales the experts' incoming grads by tp/ep (see the module docstring);
        # undo that on the grads flowing back to the tokens, which must stay unscaled.
        recv = _ScaleGrad.apply(recv, ep / self.tp)
        # (source rank, local expert) order -> (local expert, source rank) order.
        segment = torch.repeat_interleave(torch.arange(ep * local_experts, device=x.device), counts_recv.flatten())
        source, expert = segment // local_experts, segment % local_experts  # (T_recv,) each
        self._permutation = torch.argsort(expert * ep + source, stable=True)  # (T_recv,)
        return recv[self._permutation], counts_recv.sum(dim=0)  # (T_recv, dim), (E_local,)

    def _dispatch_balanced(self, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        """``_dispatch`` under assumed balanced routing (``MoEArgs.balanced_routing``, the memory estimate):
        equal splits to and from every EP peer, known on the host, so no count exchange is needed and
        no tensor value is read (fake tensors). The same tensors and collectives as the real dispatch."""
        x, counts = inputs  # (T*k, dim) sorted by expert; (E,)
        ep, group = device_mesh.size(), device_mesh.get_group()
        local_experts = counts.numel() // ep
        self._input_splits = self._output_splits = balanced_split(x.shape[0], ep)
        recv = funcol.all_to_all_single_autograd(x, self._output_splits, self._input_splits, group)
        recv = _ScaleGrad.apply(recv, ep / self.tp)
        self._permutation = torch.arange(recv.shape[0], device=x.device)  # the real one is an argsort
        local_counts = torch.tensor(balanced_split(recv.shape[0], local_experts), dtype=torch.int64)
        return recv[self._permutation], local_counts.to(x.device)

    def _combine(self, module: nn.Module, out: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
        ep, group = device_mesh.size(), device_mesh.get_group()
        # Expert grads come out summed over the EP ranks' tokens; tp/ep makes them the average
        # over the EP group's data-parallel ranks (1/ep without TP).
        out = _ScaleGrad.apply(out, self.tp / ep)  # (T_recv, dim) in (local expert, source rank) order
        out = out[torch.argsort(self._permutation)]  # back to (source rank, local expert) order
        return funcol.all_to_all_single_autograd(out, self._input_splits, self._output_splits, group)  # (T, dim)


def _shard_experts(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
    # Shard(0): the expert dim of the stacked (E, ., .) weights, so rank r holds experts
    # [r * E/ep, (r+1) * E/ep), matching the contiguous per-rank chunks of the dispatch.
    # requires_grad kept: a frozen expert (LoRA's base) stays frozen (nn.Parameter's default would make it trainable).
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(param_name, sharded)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, *, tp: int = 1) -> None:
    """Apply ``ExpertParallel`` to the experts of every MoE layer of ``model`` (in place).

    ``tp``: the tensor-parallel ranks contained in ``ep_mesh`` (1 when EP is made of dp ranks only).
    """
    for module in list(model.modules()):
        if isinstance(module, GroupedExperts):
            parallelize_module(module, ep_mesh, ExpertParallel(tp=tp))
