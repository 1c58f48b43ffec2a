"""Multi-token prediction in the training step: the loss over the depths' logits, and their per-depth metrics.

With ``model.mtp_layers = D``, the training forward (``StepFunction.forward_backward``) asks the model for its
depths too (``model(inputs, mtp=True)``: the logits (bs, (1 + D) * seqlen, vocab), the model's first).
``MtpLoss`` wraps the run's loss: it returns the model's loss (what the step logs as ``loss``) and keeps
``training.mtp_loss_weight / D`` times the sum of the depths' losses (the DeepSeek-V3 report's lambda / D), which
the step back-propagates with it as a family's aux loss (``StepHooks.aux_loss``, at the micro-batch's scale). Each
depth's loss is its mean cross-entropy over its own counted labels (models/common/mtp.py ``mtp_labels``) in the
micro-batch. Validation and evaluation forwards ask for no depths: their loss is the model's alone. ``mtp_loss`` in
the step record: each depth's mean cross-entropy over the step's global batch, depth 1 first.

With ``mtp_loss_weight = 0`` every depth term is an exact zero: the model's loss, gradients and updates are bit
for bit those of the run without MTP (the depths' own weights do not touch them, and are initialised by name:
models/deepseek_v3/model.py ``init_units``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch

from torchtitan.distributed.mesh import StepMeans
from torchtitan.models.common.documents import IGNORE_INDEX
from torchtitan.models.common.mtp import mtp_labels

# components/loss.py's LossFn, spelled out: this folder sits below components/ (docs/design.md's floors)
LossFn = Callable[..., torch.Tensor]

if TYPE_CHECKING:
    from torchtitan.config.schema import Training
    from torchtitan.distributed.mesh import OuterSum, WorldMesh
    from torchtitan.distributed.pipeline.stages import ShapeInference


class MtpLoss:
    """The run's loss over ``model(inputs, mtp=True)``'s logits, and the step hooks (``spec.StepHooks``) that add the
    depths' term to its backward and log each depth's loss."""

    def __init__(
        self,
        loss_fn: LossFn,
        *,
        depths: int,
        weight: float,
        world: WorldMesh,
        device: torch.device,
        shape_inference: ShapeInference | None = None,
    ):
        """``shape_inference``: active while a pipeline's last stage runs this loss on its shape-inference forward's
        output (not counted)."""
        self.loss_fn, self.depths, self.weight, self.world = loss_fn, depths, weight, world
        self.shape_inference = shape_inference
        self.means = StepMeans(depths, world, device)  # each depth's loss over the step's global batch
        self.term: torch.Tensor | None = None  # the last training forward's lambda / D * sum of depth losses

    def __call__(
        self, pred: torch.Tensor, labels: torch.Tensor, reduction: Literal["mean", "sum"] = "mean"
    ) -> torch.Tensor:
        """The model's loss. pred (bs, seqlen, vocab): the model's logits alone (validation); (bs, (1 + D) * seqlen,
        vocab): a training forward's, whose depths' term ``aux_loss`` then hands to the backward."""
        seqlen = labels.shape[1]
        if pred.shape[1] == seqlen:
            return self.loss_fn(pred, labels, reduction=reduction)
        model_logits, *depths = pred.split(seqlen, dim=1)  # each (bs, seqlen, vocab)
        terms = []
        record = self.shape_inference is None or not self.shape_inference.active
        for k, logits in enumerate(depths, start=1):
            target = mtp_labels(labels, k)  # (bs, seqlen)
            counted = (target != IGNORE_INDEX).sum()
            total = self.loss_fn(logits, target, reduction="sum")
            if record:
                self.means.add(k - 1, _plain(total), counted.double())
            terms.append(total / counted.clamp(min=1))
        self.term = torch.stack(terms).sum() * (self.weight / len(depths))
        return self.loss_fn(model_logits, labels, reduction=reduction)

    def aux_loss(self, model_part: Any, scale: float) -> torch.Tensor | None:
        """The step's hook: ``take_term``."""
        return self.take_term(scale)

    def take_term(self, scale: float) -> torch.Tensor | None:
        """The last training forward's depth term at the micro-batch's ``scale`` (taken: once per forward). Under
        pipeline parallel the last stage's loss takes it (components/step.py ``PipelineLoss``), not the step."""
        term, self.term = self.term, None
        return None if term is None else term * scale

    @torch.no_grad()
    def reduce_step(self, *, keep_metrics: bool, outer_sum: OuterSum | None) -> None:
        """Log steps: each depth's sums over every rank holding other tokens (data parallel) and over the pipeline
        ranks (only the last stage's hold them, the others zeros); every rank calls it."""
        self.means.reduce(keep_metrics)

    def after_optimizer_step(self) -> None:
        pass

    def discard_step(self) -> None:
        self.means.take()

    def metrics(self) -> tuple[dict[str, Any], dict[str, float]] | None:
        """({"mtp_loss": [depth 1, ...]}, TensorBoard's "loss_metrics/mtp_loss_depth_k"), or None."""
        last = self.means.take()
        if last is None:
            return None
        return {"mtp_loss": last}, {f"loss_metrics/mtp_loss_depth_{k}": v for k, v in enumerate(last, start=1)}


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor (loss parallel returns a replicated DTensor)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def build_mtp_step(
    loss_fn: LossFn,
    training: Training,
    *,
    depths: int,
    world: WorldMesh,
    device: torch.device,
    inference: ShapeInference | None = None,
) -> MtpLoss | None:
    """The loss and step hooks of ``depths`` MTP depths (``model_args.mtp_layers``) over ``loss_fn``, weighed by
    ``training.mtp_loss_weight``; None for 0 depths. ``inference``: the pipeline stages' shape inference."""
    if depths == 0:
        return None
    return MtpLoss(
        loss_fn,
        depths=depths,
        weight=training.mtp_loss_weight,
        world=world,
        device=device,
        shape_inference=inference,
    )
