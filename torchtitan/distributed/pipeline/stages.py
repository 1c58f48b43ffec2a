"""Pipeline parallel with ``torch.distributed.pipelining``: stages, schedule, one step.

The model is split by hand (torchtitan style): each stage is a fresh meta-device build of the
model pruned by the family's split function to a contiguous range of ``layers`` (ModuleDict keys
unchanged, so parameter names and checkpoints stay the same as the whole model's), the embedding
only on the first stage and the final norm + output projection only on the last. The layout
(which layers, which stages on which rank, CSV schedules) is ``pipeline/layout.py``'s.

GPipe memory: torch 2.13's GPipe (and its runtime schedules) keep every forward-send ``Work`` until
the end of ``step``, and a gloo ``Work`` holds its tensor until it is destroyed, so every
microbatch's stage output stays alive through the whole backward even though autograd only
needs its ``grad_fn``. ``_OutputReleasingStage`` sends the activations itself, waits for the send
one microbatch later, then swaps the output's storage for a one-element placeholder. torch 2.15's
stages drop a sent output themselves once its send completes (``release_fwd_send_outputs``, keeping
only its gradient edge for backward); there the plain stage is used.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime, get_schedule_class
from torch.distributed.tensor import DTensor

from torchtitan.distributed.pipeline.layout import (
    _K_CSV,
    SINGLE_STAGE_SCHEDULES,
    canonical_schedule,
    resolve_stage_layout,
    stage_ids_for_rank,
    validate_microbatches,
)
from torchtitan.models.common.ends import model_ends

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)


def prune_to_stage(model: nn.Module, first_layer: int, end_layer: int, is_first: bool, is_last: bool) -> None:
    """Keep layers [first_layer, end_layer) of a llama-style meta model and the ends it owns, else None: the model's
    ``input_modules`` (the embedding; an image model's vision tower) only on the first stage, its ``output_modules``
    (the final norm and output; DeepSeek-V4's ``hc_head``; DeepSeek-V3's multi-token-prediction depths ``mtp``,
    with the head they share) only on the last."""
    for name in list(model.layers.keys()):
        if not first_layer <= int(name) < end_layer:
            del model.layers[name]
    inputs, outputs = model_ends(model)
    dropped = (() if is_first else inputs) + (() if is_last else outputs)
    for name in dropped:
        setattr(model, name, None)


class ShapeInference:
    """Whether one of a pipeline's stages is running torch's metadata (shape) inference forward.

    torch 2.13 stages infer their input/output shapes by running the stage once on the first ``step`` of each mode
    (training, evaluation; later stages on uninitialised tensors), and the last stage's loss on its output. Side
    effects of that forward, like MoE token counts (features/moe_balance/load_balancing.py) or the document feed's
    queue (features/documents/feed.py), and of that loss (features/mtp/step.py's per-depth sums), must be ignored: the build makes one, hands it to the stages (the one writer) and to those hooks (readers).
    Without pipeline parallel nothing enters it, so it is never active.
    """

    def __init__(self) -> None:
        self._depth = 0

    @property
    def active(self) -> bool:
        return self._depth > 0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1


# torch 2.15's stages release a sent forward output themselves (and no longer keep ``fwd_cache``); 2.11-2.14 do not
TORCH_RELEASES_SENT_OUTPUTS = hasattr(PipelineStage, "release_fwd_send_outputs")


class _Stage(PipelineStage):
    """PipelineStage that marks its shape-inference forward in ``shape_inference`` (see ``ShapeInference``)."""

    def __init__(self, *args: Any, shape_inference: ShapeInference, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.shape_inference = shape_inference

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any):
        with self.shape_inference.running():
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any):
        # torch 2.13 runs the last stage's loss on that forward's output (multi-token prediction's per-depth sums)
        with self.shape_inference.running():
            return super()._backward_metadata_inference(*args, **kwargs)

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        # torch 2.11 warms up each neighbour with a send and a receive, a neighbour on this rank too (the V
        # schedules' middle stages), which gloo cannot do (it has no pair to itself: "Pair is not connected").
        # torch 2.12 and later warm PipelineStages up another way and never call this.
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]


class _OutputReleasingStage(_Stage):
    """A stage that frees each forward output's storage once its send has completed.

    Backward only needs the output's grad_fn and shape (``torch.autograd.backward`` checks that the
    received gradient has the output's size), so the storage is replaced by a single element
    expanded to the same shape. Autograd nodes that saved the output hold their own shallow copy,
    so gradients stay exact; only the memory nobody else references is freed.

    Waiting on a send blocks until the next stage has posted its receive. That is deadlock-free only
    where the receiver's forward recv for microbatch i depends on nothing but our earlier sends,
    which is true of GPipe's all-forward phase; hence only GPipe uses this class.
    """

    def __init__(self, *args: Any, max_unwaited_sends: int = 1, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # one unwaited send of slack, so we do not stall on the receiver finishing its last forward
        self._max_unwaited = max_unwaited_sends
        self._pending: deque[tuple[list[dist.Work], tuple[Any, ...]]] = deque()

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if not ops:
            return ops
        # we issue the sends ourselves so that we own the Work, and with it the send buffer's lifetime
        works = [op.op(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer) for op in ops]
        self._pending.append((works, self.fwd_cache[fwd_chunk_id][0]))
        while len(self._pending) > self._max_unwaited:
            self._finish_oldest_send()
        return []

    def _finish_oldest_send(self) -> None:
        works, outputs = self._pending.popleft()
        for work in works:
            work.wait()
        del works  # a gloo Work keeps its tensor alive until it is destroyed
        for out in outputs:
            _release_storage(out)

    def finish_sends(self) -> None:
        """Wait for (and release) every outstanding send."""
        while self._pending:
            self._finish_oldest_send()

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        # GPipe has received this microbatch's gradient, so the next stage has run all its forwards:
        # every send has been received and waiting costs nothing.
        self.finish_sends()
        return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def clear_runtime_states(self) -> None:
        self.finish_sends()
        super().clear_runtime_states()


def _release_storage(out: Any) -> None:
    # Views cannot have their data swapped, and DTensor outputs keep their local tensor elsewhere.
    if not isinstance(out, torch.Tensor) or isinstance(out, DTensor) or out._is_view() or out.grad_fn is None:
        return
    out.data = torch.empty(1, dtype=out.dtype, device=out.device).expand(out.shape)


@dataclass
class PipelineParts:
    schedule: Any
    model_parts: list[nn.Module]
    stages: list[PipelineStage]
    has_first_stage: bool
    has_last_stage: bool
    n_microbatches: int  # each stage's backward runs this often per step; grads are scaled by 1/it


def _build_schedule(
    stages: list[PipelineStage], schedule: str, csv_path: str, n_microbatches: int, loss_fn: Callable
) -> Any:
    if csv_path:
        runtime = _PipelineScheduleRuntime(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
        try:
            runtime._load_csv(csv_path)
        except (AssertionError, RuntimeError, ValueError, KeyError) as e:
            raise ValueError(
                f"{_K_CSV} = {csv_path!r} is not a valid schedule for {n_microbatches} microbatches "
                f"and {stages[0].num_stages} stages: {e}"
            ) from e
        return runtime
    cls = get_schedule_class(schedule)
    if schedule in SINGLE_STAGE_SCHEDULES:
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)


def build_pipeline(
    build_meta_model: Callable[[], nn.Module],
    *,
    n_layers: int,
    split_fn: Callable[[nn.Module, int, int, bool, bool], None],
    pp_mesh: DeviceMesh,
    device: torch.device,
    n_microbatches: int,
    local_batch_size: int,
    schedule: str,
    split_points: list[str],
    csv_path: str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    finish_stage: Callable[[nn.Module], None],
    shape_inference: ShapeInference,
    release_sent_outputs: bool = True,
) -> PipelineParts:
    """Build this rank's stages (each a fresh meta model pruned by ``split_fn``), finish each, build the schedule.

    ``finish_stage`` applies TP/AC/compile/FSDP, ``to_empty`` and init to one part in place.
    ``shape_inference``: marked while a stage runs its shape-inference forward (read by hooks on the parts).
    ``release_sent_outputs`` (GPipe only) frees each stage output once sent; see _OutputReleasingStage (torch
    2.15 does it itself: the flag changes nothing there).
    """
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    layout = resolve_stage_layout(n_layers, pp, schedule, split_points, csv_path)
    canonical = canonical_schedule(schedule, csv_path)
    num_stages = len(layout)
    validate_microbatches(canonical, n_microbatches, local_batch_size, num_stages, pp)
    ours = release_sent_outputs and canonical == "GPipe" and not TORCH_RELEASES_SENT_OUTPUTS
    stage_cls = _OutputReleasingStage if ours else _Stage
    parts, stages = [], []
    for stage_id in stage_ids_for_rank(pp_rank, pp, num_stages, canonical):
        first, end = layout[stage_id]
        part = build_meta_model()
        split_fn(part, first, end, stage_id == 0, stage_id == num_stages - 1)
        finish_stage(part)
        parts.append(part)
        stage = stage_cls(
            part, stage_id, num_stages, device, group=pp_mesh.get_group(), shape_inference=shape_inference
        )
        stages.append(stage)
        logger.info("pp rank %d: stage %d of %d holds layers %d..%d", pp_rank, stage_id, num_stages, first, end - 1)
    return PipelineParts(
        schedule=_build_schedule(stages, canonical, csv_path, n_microbatches, loss_fn),
        model_parts=parts,
        stages=stages,
        has_first_stage=any(s.is_first for s in stages),
        has_last_stage=any(s.is_last for s in stages),
        n_microbatches=n_microbatches,
    )


def _first_stage_args(parts: PipelineParts, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # contiguous: the batch is a view of each sample's (seq_len + 1)-token window, and torch 2.11's stages check
    # every micro-batch's strides against the contiguous metadata they inferred (2.12 and later compare shapes only)
    return (inputs.contiguous(),) if parts.has_first_stage else ()


def pipeline_step(
    parts: PipelineParts, inputs: torch.Tensor, labels: torch.Tensor, kwargs: Mapping[str, Any] | None = None
) -> torch.Tensor | None:
    """One forward + backward over the whole local batch; the mean microbatch loss on last-stage ranks.

    Gradients are those of the mean loss over the batch (schedules scale by 1/n_microbatches). ``kwargs``: every
    stage's forward gets them (each rank passes the same); they may change what stages hand on (multi-token
    prediction's ``mtp=True``), which torch infers once per mode, so all training steps must pass the same ones.
    """
    args = _first_stage_args(parts, inputs)
    target = labels if parts.has_last_stage else None
    losses: list[torch.Tensor] | None = [] if parts.has_last_stage else None
    # return_outputs=False: the last stage would otherwise keep every microbatch's logits
    parts.schedule.step(*args, target=target, losses=losses, return_outputs=False, **(kwargs or {}))
    for stage in parts.stages:
        if isinstance(stage, _OutputReleasingStage):
            stage.finish_sends()
    return torch.stack(losses).mean() if losses is not None else None


def pipeline_eval(parts: PipelineParts, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """Forward only over the local batch: the mean microbatch loss on last-stage ranks, else None."""
    losses: list[torch.Tensor] = []
    kwargs = {"target": labels, "losses": losses} if parts.has_last_stage else {}
    args = _first_stage_args(parts, inputs)
    parts.schedule.eval(*args, **kwargs)
    return torch.stack([x.detach() for x in losses]).mean() if losses else None
