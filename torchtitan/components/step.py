"""The one forward + loss (+ backward) path, used by training, validation and the memory estimator.

``StepFunction`` is chosen once from the build (pipelined or not, chunked loss or not, a family's
aux loss or not) and then called per micro-batch, so training and evaluation cannot drift: both
run under the same autocast and the same loss context (loss parallel). Under pipeline parallel the
schedule runs the loss (and its backward) inside, and only ranks holding the last stage get a
loss; ``reduce_loss`` brings it to every rank with one sum over the pp axis, the only place that
knows losses live on one pipeline rank.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.components.loss import chunked_cross_entropy, cross_entropy_loss
from torchtitan.components.optimizer import build_optimizer_in_backward
from torchtitan.distributed.grad_norm import clip_grad_norm_, reduce_partial_grads_
from torchtitan.distributed.pipeline import pipeline_eval, pipeline_step
from torchtitan.models.documents import IGNORE_INDEX

if TYPE_CHECKING:
    from torch import nn

    from torchtitan.components.document_feed import DocumentFeed
    from torchtitan.components.optimizer_in_backward import OptimizerInBackward
    from torchtitan.config.schema import Optimizer as OptimizerConfig
    from torchtitan.distributed.mesh import WorldMesh
    from torchtitan.distributed.pipeline import PipelineParts
    from torchtitan.spec import StepHooks


class PipelineLoss:
    """The loss a pipeline schedule runs on its last stage (the schedule averages over its micro-batches).

    ``divisor``: the gradient-accumulation steps while training (so accumulated gradients are those
    of the mean), 1 while evaluating; set by ``StepFunction`` before each schedule call.
    """

    def __init__(self) -> None:
        self.divisor = 1
        self.token_weight: float | None = None  # see StepFunction.count_tokens

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.token_weight is None:
            return cross_entropy_loss(pred, labels) / self.divisor
        return cross_entropy_loss(pred, labels, reduction="sum") * (self.token_weight / self.divisor)


class StepFunction:
    """Forward, loss and (for training) backward of one micro-batch on this rank's model parts."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        *,
        world: WorldMesh,
        device: torch.device,
        amp_dtype: torch.dtype | None,
        loss_chunk_size: int = 0,
        pipeline: PipelineParts | None = None,
        pipeline_loss: PipelineLoss | None = None,
        hooks: StepHooks | None = None,
    ):
        """``amp_dtype``: autocast's dtype, or None (FSDP's mixed precision or fp32 computes without it)."""
        self.model_parts, self.world, self.device = model_parts, world, device
        self.amp_dtype, self.loss_chunk_size = amp_dtype, loss_chunk_size
        self.pipeline, self.hooks = pipeline, hooks
        self.loss_context = loss_parallel if world.dims.loss_parallel_enabled else contextlib.nullcontext
        self.pipeline_loss = pipeline_loss
        self.feed: DocumentFeed | None = None  # block_causal attention: the batches' documents (the trainer sets it)
        self.token_weight: float | None = None  # with a feed: see count_tokens

    def count_tokens(self, batches: list[tuple[torch.Tensor, torch.Tensor]], *, record: bool = True) -> None:
        """block_causal: weigh each token equally over the global batch (and, with ``record``, add the
        batches' document statistics to the feed's, which the step metrics read; validation does not).

        Ignored labels (one per document) make the local batches' counted tokens differ, so the mean
        of per-rank, per-micro-batch means would not be the global batch's mean (nor one process's).
        Each unit (micro-batch of a dp/cp rank, accumulation step, pipeline micro-batch) then returns
        its summed loss x units / (counted tokens of the global batch): the averages the step already
        takes over those units give the global mean over counted tokens, its gradient included.
        """
        if self.feed is None:
            return
        if record:
            self.feed.record(batches)
        count = sum((labels != IGNORE_INDEX).sum() for _, labels in batches).float()
        group = self.world.group("dp_cp")
        if group is not None:
            dist.all_reduce(count, group=group)
        ranks = dist.get_world_size(group) if group is not None else 1
        units = len(batches) * (self.pipeline.n_microbatches if self.pipeline is not None else 1) * ranks
        # Under the memory estimator's fake tensors the count cannot be read; the weight's value
        # changes no memory: every label of the global batch counted stands in.
        counted = count.item() if not is_fake(count) else ranks * sum(labels.numel() for _, labels in batches)
        self.token_weight = units / max(counted, 1.0)
        if self.pipeline_loss is not None:
            self.pipeline_loss.token_weight = self.token_weight

    def documents(self, batch: tuple) -> contextlib.AbstractContextManager:
        """The forwards inside see ``batch``'s documents (``Batch.docs``, block_causal); else nothing to do."""
        docs = getattr(batch, "docs", None)
        return self.feed.use(docs) if self.feed is not None and docs is not None else contextlib.nullcontext()

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, *, accum_steps: int) -> torch.Tensor | None:
        """Train on one micro-batch of ``accum_steps``; the gradient is that of the mean over them.

        Returns the detached plain loss scaled by 1/accum_steps, or None where it is not known (a
        pipeline rank without the last stage).
        """
        if self.pipeline is not None:
            self.pipeline_loss.divisor = accum_steps
            with self.autocast(), self.loss_context():  # the schedule runs the loss and its backward inside
                loss = pipeline_step(self.pipeline, inputs, labels)
            return None if loss is None else _plain(loss)
        loss = self._loss(inputs, labels) * (1.0 / accum_steps)
        with self.loss_context():
            self._backward(loss, 1.0 / accum_steps)
        return _plain(loss)

    @torch.no_grad()
    def forward_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Evaluate one batch: the plain mean loss (0 where a pipeline rank does not hold it)."""
        if self.pipeline is not None:
            self.pipeline_loss.divisor = 1
            with self.autocast(), self.loss_context():
                loss = pipeline_eval(self.pipeline, inputs, labels)
            return torch.zeros((), device=self.device) if loss is None else _plain(loss)
        return _plain(self._loss(inputs, labels))

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        model = self.model_parts[0]
        if self.loss_chunk_size > 0:
            with self.autocast():
                hidden = model(inputs, return_hidden=True)  # (bs, seqlen, dim); Shard(1) DTensor under SP
            if isinstance(model, FSDPModule):
                # The root FSDP unit (which owns ``output``) resharded after forward; gather it again for
                # the loss. Its gradient is reduce-scattered by the root's post-backward, as usual.
                model.unshard()
            # The output projection runs per chunk inside the loss, under the forward's autocast
            # (checkpoint replays that autocast state when it recomputes a chunk in backward).
            with self.loss_context(), self.autocast():
                return self._weighted(
                    chunked_cross_entropy(
                        hidden, model.output, labels, chunk_size=self.loss_chunk_size, reduction=self._reduction()
                    )
                )
        with self.autocast():
            pred = model(inputs)  # (bs, seqlen, vocab); vocab-sharded DTensor under loss parallel
        with self.loss_context():
            return self._weighted(cross_entropy_loss(pred, labels, reduction=self._reduction()))

    def _reduction(self) -> str:
        return "mean" if self.token_weight is None else "sum"

    def _weighted(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.token_weight is None else loss * self.token_weight

    def _backward(self, loss: torch.Tensor, scale: float) -> None:
        """Backward of the loss, plus the family's aux loss at the same scale (the logged loss stays the CE)."""
        aux = self.hooks.aux_loss(self.model_parts[0], scale) if self.hooks is not None else None
        if aux is None:
            loss.backward()
        else:
            torch.autograd.backward([loss, aux])  # loss may be a DTensor (loss parallel), aux is not

    def build_optimizer_in_backward(
        self, optimizer: torch.optim.Optimizer, config: OptimizerConfig
    ) -> OptimizerInBackward:
        """Hooks that step each parameter of ``optimizer`` as its gradient is final, during backward.

        Under pipeline parallel a stage's backward runs once per micro-batch (FSDP reduces after the
        last one) and the schedule would scale the gradients by 1/micro-batches after it; the grad
        norm is summed over the pp axis too, as in ``clip_grad_norm_``.
        """
        return build_optimizer_in_backward(
            optimizer,
            config,
            pipeline_microbatches=self.pipeline.n_microbatches if self.pipeline is not None else 1,
            fsdp=self.world.dims.fsdp_enabled,
            pp_group=self.world.group("pp"),
        )

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Finish the gradients (partial DTensor grads reduced), clip them; returns the total norm.

        Parameters are sharded over every mesh axis but the pure data-parallel ones, and pipeline
        ranks hold disjoint layers: the norm's square sum is all-reduced once over all of them.
        """
        params = [p for part in self.model_parts for p in part.parameters()]
        reduce_partial_grads_(params)
        pp_group = self.world.group("pp")
        return clip_grad_norm_(params, max_norm, extra_groups=[pp_group] if pp_group else [])

    def reduce_loss(self, loss: torch.Tensor, *, with_max: bool = True) -> tuple[float, float]:
        """(mean, max) over the ranks that see different data of a per-rank mean loss; every rank gets them.

        Under pipeline parallel only the last stage's ranks hold a loss (the others 0): a sum over
        the pp axis brings it to every rank first.
        """
        pp_group, loss_group = self.world.group("pp"), self.world.group("dp_cp")
        if pp_group is not None:
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=pp_group)
        if loss_group is None:
            return loss.item(), loss.item()
        both = torch.stack([loss.detach().float(), loss.detach().float()])
        dist.all_reduce(both[:1], op=dist.ReduceOp.SUM, group=loss_group)
        if with_max:
            dist.all_reduce(both[1:], op=dist.ReduceOp.MAX, group=loss_group)
        return both[0].item() / dist.get_world_size(loss_group), both[1].item()


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor (loss parallel returns a replicated DTensor)."""
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
