"""The trainer's side of MoE load balancing: token counts per expert over a step, reduced globally.

``ExpertLoadTracker`` sums every MoE layer's ``tokens_per_expert`` over the step's micro-batches
(forward hooks, so pipeline schedules, which run the micro-batches themselves, are counted too),
then one all-reduce (SUM) over *every* rank gives the global counts of the step:

* data-parallel, CP and (sequence-parallel) TP ranks hold different tokens, so their counts add;
* pipeline ranks own different layers: each rank fills only its own layers' rows of a table
  covering the whole model, zeros elsewhere, so the sum over pp leaves each layer's own counts.

The same table feeds ``update_expert_bias`` (every step, load_balance = "bias"; every rank of a
stage applies the same update to the layers it holds, so the bias stays replicated) and the
expert-load metrics (log steps). The counts, and so the bias, do not depend on the layout. They are
reduced after backward (``reduce``) and applied after the optimizer step (``apply``): the reduction
sits before the step is committed, where fault tolerance's replica groups can still add theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torchtitan.distributed.mesh import OuterSum, WorldMesh
    from torchtitan.distributed.pipeline.stages import ShapeInference


def _in_recompute() -> bool:
    # Activation checkpointing re-runs a block's forward inside the backward pass (a graph task
    # is running then); its routing repeats the original forward's and must not count twice.
    return torch._C._current_graph_task_id() != -1


class ExpertLoadTracker:
    """Counts tokens per expert of this rank's MoE layers; ``reduce`` makes them global, ``apply`` uses them."""

    def __init__(
        self,
        layer_names: Sequence[str],
        num_experts: int,
        model_parts: Sequence[nn.Module],
        device: torch.device,
        *,
        shape_inference: ShapeInference,
    ):
        """``layer_names``: the whole model's MoE layers ("1", "2", ...), the same order on every rank;
        ``shape_inference``: active during a pipeline stage's shape-inference forward (not counted)."""
        self.shape_inference = shape_inference
        self.layer_names = list(layer_names)
        self.num_experts = num_experts
        self.counts: torch.Tensor | None = None  # (num_moe_layers, num_experts), this rank, this step
        self.last: dict[str, list[float]] | None = None  # the last reduced counts, "layers.N" -> per expert
        self.pending: tuple[torch.Tensor, bool, bool] | None = None  # reduced, not yet applied (reduce -> apply)
        self.device = device
        self.model_parts = list(model_parts)
        for part in self.model_parts:
            for name, moe in part.moe_layers().items():
                moe.register_forward_hook(self._hook(self.layer_names.index(name)))

    def _hook(self, row: int):
        def count(module: nn.Module, inputs, output) -> None:
            # Training forwards only: validation runs without grad, a recompute inside backward,
            # a pipeline stage's shape inference on placeholder inputs.
            if not torch.is_grad_enabled() or _in_recompute() or self.shape_inference.active:
                return
            if self.counts is None:
                self.counts = self._zeros()
            self.counts[row] += module.tokens_per_expert

        return count

    @torch.no_grad()
    def reduce(self, *, update_bias: bool, keep: bool, outer_sum: OuterSum | None = None) -> None:
        """Reduce the step's counts over all ranks (and, for the bias, over fault tolerance's replica groups);
        ``apply`` then updates the bias and keeps them for metrics, ``drop`` forgets them.

        Every rank must call it with the same flags (the all-reduce is collective); ``outer_sum`` is called
        every step the bias updates, on every group alike.
        """
        counts, self.counts, self.pending = self.counts, None, None
        if not (update_bias or keep):
            return
        if counts is None:  # this rank holds no MoE layer (a pipeline stage of dense layers)
            counts = self._zeros()
        if dist.is_initialized():
            dist.all_reduce(counts)
        if update_bias and outer_sum is not None:
            outer_sum(counts)  # the counts of every live replica group's tokens, as HSDP's would be
        self.pending = (counts, update_bias, keep)

    @torch.no_grad()
    def apply(self) -> None:
        """The reduced counts of an applied step: the expert bias update (load_balance = "bias"), the metrics."""
        if self.pending is None:
            return
        counts, update_bias, keep = self.pending
        self.pending = None
        if update_bias:
            table = {name: counts[i] for i, name in enumerate(self.layer_names)}
            for part in self.model_parts:
                part.update_expert_bias({name: table[name] for name in part.moe_layers()})
        self.last = {f"layers.{name}": counts[i].tolist() for i, name in enumerate(self.layer_names)} if keep else None

    def drop(self) -> None:
        """A dropped step: its token counts move no bias and count in no metric."""
        self.counts, self.pending = None, None

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(len(self.layer_names), self.num_experts, device=self.device)


class LoadBalancer:
    """The MoE family's step hooks (``models.spec.StepHooks``): aux loss, expert-bias update, load metrics."""

    def __init__(self, args, tracker: ExpertLoadTracker, tp: int, *, base_frozen: bool = False):
        """``base_frozen`` (adapters on a frozen base: LoRA): the expert bias is part of the frozen base and is not
        updated (docs/lora.md)."""
        self.args, self.tracker, self.tp = args, tracker, tp
        self.update_bias = args.load_balance == "bias" and not base_frozen

    def aux_loss(self, model_part: nn.Module, scale: float) -> torch.Tensor | None:
        """The switch-style balance loss (load_balance = "aux_loss"), at the micro-batch's scale.

        Every rank adds it with the same weight (distributed/expert_parallel/moe_balance.py relies on that): data parallel
        averages its gradients over the dp x cp ranks; TP ranks (each routing its own sequence shard) get
        1/tp so the sum of their router grads is their mean. Its statistics are those of the global
        micro-batch or, with training.moe_aux_loss_scope = "local_micro_batch", of this rank's tokens.
        """
        if self.args.load_balance != "aux_loss":
            return None
        return model_part.aux_loss() * (scale / self.tp)

    def reduce_step(self, *, keep_metrics: bool, outer_sum: OuterSum | None) -> None:
        if self.args.balanced_routing:
            self.tracker.drop()  # assumed counts (memory estimation) are not the router's: they must not move the bias
            return
        # global token counts: the expert bias update and the load metrics
        self.tracker.reduce(update_bias=self.update_bias, keep=keep_metrics, outer_sum=outer_sum)

    def after_optimizer_step(self) -> None:
        self.tracker.apply()

    def discard_step(self) -> None:
        """A skipped (non-finite or uncommitted) step: its token counts move no bias and count in no metric."""
        self.tracker.drop()

    def metrics(self) -> tuple[dict[str, Any], dict[str, float]] | None:
        """(record fields, TensorBoard scalars) of the last kept step's expert load, or None."""
        if self.tracker.last is None:
            return None
        moe = compute_load_metrics(self.tracker.last)
        return moe, {f"moe/{name}/imbalance": v for name, v in moe["expert_imbalance"].items()}


def build_load_balancer(
    args,
    whole: nn.Module,
    model_parts: list[nn.Module],
    world: WorldMesh,
    device: torch.device,
    *,
    shape_inference: ShapeInference,
) -> LoadBalancer | None:
    """The MoE spec's ``build_step_hooks``; None for a model without MoE layers."""
    layers = list(whole.moe_layers())
    if not layers:
        return None
    # A run that freezes a base (LoRA: every parameter but the adapters; the same on every rank, pipeline stages
    # included) keeps the expert bias, a base buffer, as loaded too: the adapters alone describe the fine-tuned model.
    base_frozen = any(not p.requires_grad for part in model_parts for p in part.parameters())
    tracker = ExpertLoadTracker(layers, args.num_experts, model_parts, device, shape_inference=shape_inference)
    return LoadBalancer(args, tracker, world.dims.tp, base_frozen=base_frozen)


def compute_load_metrics(load: dict[str, list[float]]) -> dict[str, object]:
    """Per layer: global tokens per expert and imbalance = max / mean (1.0 is perfectly even)."""
    imbalance = {}
    for name, counts in load.items():
        mean = sum(counts) / len(counts)
        imbalance[name] = max(counts) / mean if mean > 0 else 0.0
    return {
        "expert_load": load,
        "expert_imbalance": imbalance,
        "expert_imbalance_max": max(imbalance.values()) if imbalance else 0.0,
    }
