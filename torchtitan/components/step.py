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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.components.batch import Batch
from torchtitan.components.loss import LossFn, chunked_cross_entropy, cross_entropy_loss
from torchtitan.distributed.grad_norm import clip_grad_norm_, reduce_partial_grads_
from torchtitan.distributed.pipeline.stages import pipeline_eval, pipeline_step
from torchtitan.models.common.documents import IGNORE_INDEX

if TYPE_CHECKING:
    from torch import nn

    from torchtitan.components.seams import BatchFeed
    from torchtitan.distributed.mesh import OuterSum, WorldMesh
    from torchtitan.distributed.pipeline.stages import PipelineParts
    from torchtitan.spec import StepHooks


@dataclass(frozen=True)
class LossScale:
    """How one pipeline schedule call weighs its micro-batches' losses.

    ``divisor``: the gradient-accumulation steps while training (so accumulated gradients are those
    of the mean), 1 while evaluating. ``token_weight``: see ``StepFunction.count_tokens`` (None: the
    plain mean loss).
    """

    divisor: int
    token_weight: float | None


class PipelineLoss:
    """The loss a pipeline schedule runs on its last stage (the schedule averages over its micro-batches).

    The schedule takes its loss function once, when it is built, and its ``step`` / ``eval`` pass
    nothing through to it; so each call's ``LossScale`` reaches it through ``scaled``, for that
    call only. Outside ``scaled`` the loss refuses to run.

    ``aux_term(scale)``: a term the loss function computed beside the loss it returns (multi-token prediction's
    depths: features/mtp/step.py ``MtpLoss.take_term``) at the micro-batch's scale, or None; the step adds a
    family's aux loss to its backward itself, but here the schedule runs the backward of the one loss it gets.
    """

    def __init__(
        self, loss_fn: LossFn = cross_entropy_loss, aux_term: Callable[[float], torch.Tensor | None] | None = None
    ) -> None:
        self.loss_fn, self.aux_term = loss_fn, aux_term
        self._scale: LossScale | None = None

    @contextlib.contextmanager
    def scaled(self, scale: LossScale) -> Iterator[None]:
        """The schedule calls inside weigh their losses by ``scale``."""
        self._scale = scale
        try:
            yield
        finally:
            self._scale = None

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        scale = self._scale
        if scale is None:
            raise RuntimeError(
                "PipelineLoss ran outside PipelineLoss.scaled: a trainer bug, not a configuration problem"
            )
        if scale.token_weight is None:
            loss = self.loss_fn(pred, labels) / scale.divisor
        else:
            loss = self.loss_fn(pred, labels, reduction="sum") * (scale.token_weight / scale.divisor)
        term = self.aux_term(1.0 / scale.divisor) if self.aux_term is not None else None
        if term is None:
            return loss
        # The schedule logs the loss it back-propagates: the term joins its gradient, not its value (x - x is 0)
        return loss + (term - term.detach())


class StepFunction:
    """Forward, loss and (for training) backward of one micro-batch on this rank's model parts."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        *,
        world: WorldMesh,
        device: torch.device,
        amp_dtype: torch.dtype | None,
        loss_fn: LossFn = cross_entropy_loss,
        loss_chunk_size: int = 0,
        pipeline: PipelineParts | None = None,
        pipeline_loss: PipelineLoss | None = None,
        hooks: StepHooks | None = None,
        feed: BatchFeed | None = None,
        train_kwargs: Mapping[str, Any] | None = None,
    ):
        """``amp_dtype``: autocast's dtype, or None (FSDP's mixed precision or fp32 computes without it).
        ``feed``: block_causal attention's feed of each batch's documents to the forwards (built over
        these model parts, built with them by ``build.build_step_function``), else None. ``loss_fn``: the
        loss over the logits (``loss.build_loss_fn``; the pipeline's ``pipeline_loss`` holds the same one).
        ``train_kwargs``: keyword arguments of the training forwards only (multi-token prediction's ``mtp=True``:
        features/mtp/step.py), not of validation's."""
        self.model_parts, self.world, self.device = model_parts, world, device
        self.amp_dtype, self.loss_fn, self.loss_chunk_size = amp_dtype, loss_fn, loss_chunk_size
        self.pipeline, self.hooks = pipeline, hooks
        self.loss_context = loss_parallel if world.dims.loss_parallel_enabled else contextlib.nullcontext
        self.pipeline_loss = pipeline_loss
        self.feed = feed
        self.train_kwargs = dict(train_kwargs or {})

    def count_tokens(self, batches: list[Batch], *, outer_sum: OuterSum | None = None) -> float | None:
        """block_causal: the token weight that weighs each token equally over the global batch, for
        ``forward_backward`` / ``forward_loss`` of these batches; None without a feed (the plain mean).
        Also adds the batches' document statistics to the feed's, which the step metrics read
        (validation counts its tokens itself: ``forward_loss_sum``). ``outer_sum``: fault tolerance's replica groups
        hold the rest of the global batch; their counts are added and each group's share weighs alike.

        Ignored labels (one per document) make the local batches' counted tokens differ, so the mean
        of per-rank, per-micro-batch means would not be the global batch's mean (nor one process's).
        Each unit (micro-batch of a dp/cp rank, accumulation step, pipeline micro-batch) then returns
        its summed loss x units / (counted tokens of the global batch): the averages the step already
        takes over those units give the global mean over counted tokens, its gradient included.
        """
        if self.feed is None:
            return None
        self.feed.record(batches)
        count = sum((batch.labels != IGNORE_INDEX).sum() for batch in batches).float()
        group = self.world.group("dp_cp")
        if group is not None:
            dist.all_reduce(count, group=group)
        ranks = dist.get_world_size(group) if group is not None else 1
        groups = outer_sum(count) if outer_sum is not None else 1  # the groups' means are averaged
        units = len(batches) * (self.pipeline.n_microbatches if self.pipeline is not None else 1) * ranks * groups
        # Under the memory estimator's fake tensors the count cannot be read; the weight's value
        # changes no memory: every label of the global batch counted stands in.
        counted = (
            count.item() if not is_fake(count) else groups * ranks * sum(batch.labels.numel() for batch in batches)
        )
        return units / max(counted, 1.0)

    def _documents(self, batch: Batch) -> contextlib.AbstractContextManager:
        """The forwards inside see ``batch``'s documents (block_causal); else nothing to do."""
        if self.feed is None or batch.docs is None:
            return contextlib.nullcontext()
        return self.feed.use(batch.docs)

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def forward_backward(self, batch: Batch, *, accum_steps: int, token_weight: float | None) -> torch.Tensor | None:
        """Train on one micro-batch of ``accum_steps``; the gradient is that of the mean over them.

        ``token_weight``: ``count_tokens`` of the step's batches. Returns the detached plain loss
        scaled by 1/accum_steps, or None where it is not known (a pipeline rank without the last stage).
        """
        with self._documents(batch):  # block_causal: the batch's documents reach every forward
            if self.pipeline is not None:
                scale = LossScale(accum_steps, token_weight)
                # the schedule runs the loss and its backward inside
                with self.pipeline_loss.scaled(scale), self.autocast(), self.loss_context():
                    loss = pipeline_step(self.pipeline, batch.inputs, batch.labels, self.train_kwargs)
                return None if loss is None else _plain(loss)
            loss = self._loss(batch, token_weight, self.train_kwargs) * (1.0 / accum_steps)
            with self.loss_context():
                self._backward(loss, 1.0 / accum_steps)
            return _plain(loss)

    def train_micro_batches(self, batches: list[Batch], *, token_weight: float | None) -> torch.Tensor:
        """``forward_backward`` on each of a step's micro-batches; returns this rank's share of the step's loss
        (0 where a pipeline rank does not hold it), its gradients accumulated in the parameters'."""
        loss_sum = torch.zeros((), device=self.device)
        for batch in batches:
            loss = self.forward_backward(batch, accum_steps=len(batches), token_weight=token_weight)
            if loss is not None:
                loss_sum += loss
        return loss_sum

    @torch.no_grad()
    def forward_loss(self, batch: Batch, *, token_weight: float | None) -> torch.Tensor:
        """Evaluate one batch (``token_weight``: its ``count_tokens``): the plain mean loss (0 where a
        pipeline rank does not hold it)."""
        with self._documents(batch):
            if self.pipeline is not None:
                with self.pipeline_loss.scaled(LossScale(1, token_weight)), self.autocast(), self.loss_context():
                    loss = pipeline_eval(self.pipeline, batch.inputs, batch.labels)
                return torch.zeros((), device=self.device) if loss is None else _plain(loss)
            return _plain(self._loss(batch, token_weight))

    @torch.no_grad()
    def forward_loss_sum(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluate one batch: (its summed token loss, its counted tokens: labels not ignored), both on this rank's
        part of the batch; on a pipeline rank without the last stage, both 0 (the loss and its count live together).
        """
        # The schedule averages its micro-batches' losses: weighing each by their number gives their sum.
        weight = float(self.pipeline.n_microbatches) if self.pipeline is not None else 1.0
        counted = (batch.labels != IGNORE_INDEX).sum()
        if self.pipeline is not None and not self.pipeline.has_last_stage:
            counted = torch.zeros_like(counted)
        return self.forward_loss(batch, token_weight=weight).float(), counted

    def _loss(self, batch: Batch, token_weight: float | None, kwargs: Mapping[str, Any] | None = None) -> torch.Tensor:
        """The micro-batch's mean loss, or with a ``token_weight`` its summed loss times the weight; ``kwargs``: the
        forward's (training's ``train_kwargs``)."""
        inputs, labels = batch.inputs, batch.labels
        reduction = "mean" if token_weight is None else "sum"
        model = self.model_parts[0]
        if self.loss_chunk_size > 0:
            with self.autocast():
                hidden = model(inputs, return_hidden=True)  # (bs, seqlen, dim); Shard(1) DTensor under SP
            if isinstance(model, FSDPModule):
                # The root FSDP unit (which owns ``output``) resharded after forward under
                # training.fsdp_reshard_after_forward = "always" (a no-op otherwise: it kept them); gather it
                # again for the loss. Its gradient is reduce-scattered by the root's post-backward, as usual.
                model.unshard()
            # The output projection runs per chunk inside the loss, under the forward's autocast
            # (checkpoint replays that autocast state when it recomputes a chunk in backward).
            with self.loss_context(), self.autocast():
                loss = chunked_cross_entropy(
                    hidden, model.output, labels, chunk_size=self.loss_chunk_size, reduction=reduction
                )
                return loss if token_weight is None else loss * token_weight
        with self.autocast():
            pred = model(inputs, **(kwargs or {}))  # (bs, seqlen, vocab); vocab-sharded DTensor under loss parallel
        with self.loss_context():
            loss = self.loss_fn(pred, labels, reduction=reduction)
            return loss if token_weight is None else loss * token_weight

    def _backward(self, loss: torch.Tensor, scale: float) -> None:
        """Backward of the loss, plus the family's aux loss at the same scale (the logged loss stays the CE)."""
        aux = self.hooks.aux_loss(self.model_parts[0], scale) if self.hooks is not None else None
        if aux is None:
            loss.backward()
        else:
            torch.autograd.backward([loss, aux])  # loss may be a DTensor (loss parallel), aux is not

    def finish_gradients(self) -> list[nn.Parameter]:
        """This rank's parameters with their gradients complete (partial DTensor gradients reduced)."""
        params = [p for part in self.model_parts for p in part.parameters()]
        reduce_partial_grads_(params)
        return params

    def clip_grad_norm_(self, max_norm: float, params: list[nn.Parameter] | None = None) -> torch.Tensor:
        """Finish the gradients (unless ``params``, from ``finish_gradients``, already are), clip them;
        returns the total norm.

        Parameters are sharded over every mesh axis but the pure data-parallel ones, and pipeline
        ranks hold disjoint layers: the norm's square sum is all-reduced once over all of them.
        """
        params = self.finish_gradients() if params is None else params
        pp_group = self.world.group("pp")
        return clip_grad_norm_(params, max_norm, extra_groups=[pp_group] if pp_group else [])

    def reduce_loss(
        self, loss: torch.Tensor, *, with_max: bool = True, max_source: torch.Tensor | None = None
    ) -> tuple[float, float]:
        """(mean, max) over the ranks that see different data of a per-rank mean loss; every rank gets them.

        Under pipeline parallel only the last stage's ranks hold a loss (the others 0): a sum over
        the pp axis brings it to every rank first. ``max_source``: the per-rank value whose max is
        wanted, if not ``loss`` itself (fault tolerance: ``loss`` is averaged over the replica
        groups, ``max_source`` their max).
        """
        pp_group, loss_group = self.world.group("pp"), self.world.group("dp_cp")
        both = torch.stack([loss.detach().float(), (loss if max_source is None else max_source).detach().float()])
        if pp_group is not None:
            dist.all_reduce(both, group=pp_group)
        if loss_group is None:
            return both[0].item(), both[1].item()
        dist.all_reduce(both[:1], op=dist.ReduceOp.SUM, group=loss_group)
        if with_max:
            dist.all_reduce(both[1:], op=dist.ReduceOp.MAX, group=loss_group)
        return both[0].item() / dist.get_world_size(loss_group), both[1].item()

    def reduce_sums(self, loss_sum: torch.Tensor, counted: torch.Tensor) -> tuple[float, int]:
        """(summed loss, counted tokens) over every rank of the global batch, from each rank's
        ``forward_loss_sum`` totals; every rank gets them. Summed over the pp axis (only the last stage's
        ranks hold them) and the data-parallel and CP ranks (each holds its part of the batch)."""
        both = torch.stack([loss_sum.detach().double(), counted.double()])
        for group in (self.world.group("pp"), self.world.group("dp_cp")):
            if group is not None:
                dist.all_reduce(both, group=group)
        return both[0].item(), round(both[1].item())


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor (loss parallel returns a replicated DTensor)."""
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
