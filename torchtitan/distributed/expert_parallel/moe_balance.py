"""Global-batch MoE balancing: the switch aux loss over every rank's tokens of the micro-batch.

The model computes its balance loss from two per-expert statistics of the tokens it routed: the routing
slots (f, no gradient) and the summed router probabilities (P, differentiable). Computed on each rank's
own tokens, the loss of a mean of products is not the product of the means, so a layout that splits the
micro-batch differently (FSDP, EP, CP, TP's sequence shards) trains another model (gpt-oss ``debugmodel``
under FSDP2 or EP2: 1.5e-4 relative from one process within 6 steps). ``apply_global_balance`` gives every MoE layer a ``StatsSum``: one all-reduce
(SUM) of the (2, E) statistics over the ranks that hold the rest of the micro-batch, so every rank
computes the same loss, that of the global micro-batch, as one process does.

The gradient (what autograd must see). Every rank adds the same loss, with the same weight (the
micro-batch's 1 / accumulation steps, and 1 / tp: see ``LoadBalancer.aux_loss``), of the same global sums,
so the gradient reaching the sums is the same on every rank. A differentiable all-reduce's backward
would all-reduce those gradients: n times the local one, for n ranks. ``_SumOverRanks`` returns exactly
that without the collective. Each rank's probability sums then carry n x their share of the global
loss's gradient, and the data-parallel mean of the router's gradient (FSDP/DDP average over dp x cp; TP
sums its sequence shards of 1/tp-weighted losses) divides the n back out: the router gets the
single-process gradient of the global loss. ``tests/distributed/test_moe_balance.py`` checks it against one
process and against torch's autograd all-reduce.

Scope: the ranks of one pipeline stage (an aux loss under PP is refused before launch), i.e. the world
when pp = 1; fault tolerance's replica groups each balance their own (the groups' gradients are averaged,
as their losses are). Gradient accumulation: each micro-batch is balanced on its own (its global
micro-batch: every dp rank's m-th micro-batch); the micro-batches of a step are not summed (the later ones
are not routed when the first runs backward). So with accumulation the loss is the same for every layout of
the same dp degree, but not across dp degrees, whose m-th micro-batches hold other samples (docs/moe.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.moe.moe import MoE


class _SumOverRanks(torch.autograd.Function):
    """All-reduce SUM forward; backward: the incoming gradient times the number of ranks (see the module
    docstring: every rank's incoming gradient is the same, so that is what the all-reduce's backward gives)."""

    @staticmethod
    def forward(ctx, stats: torch.Tensor, group: dist.ProcessGroup | None, ranks: int) -> torch.Tensor:
        ctx.ranks = ranks
        total = stats.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.ranks, None, None


class GlobalStatsSum:
    """A ``models.moe.moe.StatsSum``: the sum of a statistics tensor over ``group`` (None: the world)."""

    def __init__(self, group: dist.ProcessGroup | None, ranks: int):
        self.group, self.ranks = group, ranks

    def __call__(self, stats: torch.Tensor) -> torch.Tensor:
        return _SumOverRanks.apply(stats, self.group, self.ranks)


def switch_aux_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers balanced by the switch aux loss over their tokens (not DeepSeek's per-sequence loss)."""
    return [
        m
        for m in model.modules()
        if isinstance(m, MoE) and m.load_balance == "aux_loss" and not m.aux_loss_per_sequence
    ]


def apply_global_balance(model: nn.Module, parallel_dims: ParallelDims) -> None:
    """Make every switch-aux-loss MoE layer of ``model`` balance over the global micro-batch (in place).

    The ranks that hold the rest of a micro-batch are all of a stage's ranks: dp_replicate x dp_shard x cp
    and tp (sequence parallel: each TP rank routes its own shard); EP ranks are among them. One process: nothing.
    """
    layers = switch_aux_layers(model)
    ranks = parallel_dims.world_size // parallel_dims.pp
    if not layers or ranks == 1:
        return
    if parallel_dims.pp > 1:  # refused before launch (models/moe/spec.py): middle stages cannot add a loss
        raise NotImplementedError("the MoE aux loss under pipeline parallel: set pipeline_parallel_degree = 1")
    stats_sum = GlobalStatsSum(None, ranks)  # pp = 1: the stage's ranks are the world
    for layer in layers:
        layer.set_stats_sum(stats_sum)
