"""Pipeline parallel for the llama family with ``torch.distributed.pipelining``.

The model is split by hand (torchtitan style): each stage is a deepcopy of the meta-device model
that keeps a contiguous range of ``layers`` (ModuleDict keys unchanged, so parameter names and
checkpoints stay the same as the whole model's), the embedding only on the first stage and the
final norm + output projection only on the last. Each rank holds one stage (single-stage
schedules) or several (multi-stage schedules): stage s on rank s % pp ("loop"), or, for the
V schedules, stages r and 2*pp-1-r on rank r, so rank 0 holds both the first and the last stage.

A custom schedule can be read from a CSV file of compute-only actions, one row per pp rank, e.g.
``0F0,0F1,0B0,0B1`` (stage, F/B/I/W, microbatch); torch adds the sends and receives. With a CSV,
``pipeline_parallel_schedule`` names the stage placement the CSV was written for: "loop" (any
non-V schedule name, such as the default "1F1B", means loop) or "v" (also "ZBVZeroBubble",
"DualPipeV"). The CSV's rows must place the stages that way; we check it.

GPipe memory: torch 2.13's GPipe (and its runtime schedules) keep every forward-send ``Work`` until
the end of ``step``, and a gloo ``Work`` holds its tensor until it is destroyed, so every
microbatch's stage output stays alive through the whole backward even though autograd only
needs its ``grad_fn``. ``_OutputReleasingStage`` sends the activations itself, waits for the send
one microbatch later, then swaps the output's storage for a one-element placeholder.
"""

from __future__ import annotations

import csv
import logging
import os
import re
from collections import deque
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime, get_schedule_class
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)

SINGLE_STAGE_SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B")
MULTI_STAGE_SCHEDULES: tuple[str, ...] = (
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
V_SCHEDULES: tuple[str, ...] = ("ZBVZeroBubble", "DualPipeV")
CSV_PLACEMENTS: tuple[str, ...] = ("loop", "v")

_SPLIT_RE = re.compile(r"layers\.(\d+)")
_K_SPLIT = "experimental.pipeline_parallel_split_points"
_K_DEGREE = "experimental.pipeline_parallel_degree"
_K_SCHEDULE = "experimental.pipeline_parallel_schedule"
_K_CSV = "experimental.pipeline_parallel_schedule_csv"
_K_MB = "experimental.pipeline_parallel_microbatches"


def _canonical_schedule(schedule: str, csv_path: str) -> str:
    """The schedule's canonical spelling (case-insensitive, like torch); with a CSV, "loop" or "v"."""
    names = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES
    by_lower = {n.lower(): n for n in names}
    canonical = by_lower.get(schedule.lower())
    if csv_path:
        if schedule.lower() in CSV_PLACEMENTS:
            return schedule.lower()
        if canonical is not None:
            return "v" if canonical in V_SCHEDULES else "loop"
        raise ValueError(
            f"{_K_SCHEDULE} = {schedule!r} with {_K_CSV} = {csv_path!r}: with a CSV schedule it names the "
            f"stage placement; allowed: {list(CSV_PLACEMENTS)} or a schedule name {list(names)}"
        )
    if canonical is None:
        raise ValueError(f"{_K_SCHEDULE} = {schedule!r} is unknown; valid schedules: {list(names)}")
    return canonical


def _is_v(schedule: str) -> bool:
    return schedule.lower() == "v" or schedule.lower() in {s.lower() for s in V_SCHEDULES}


def _parse_split_points(split_points: list[str], n_layers: int) -> list[int]:
    starts = []
    for point in split_points:
        match = _SPLIT_RE.fullmatch(point.strip())
        if match is None:
            raise ValueError(f"{_K_SPLIT} = {split_points}: {point!r} is not of the form 'layers.N'")
        starts.append(int(match.group(1)))
    for prev, cur in zip(starts, starts[1:]):
        if cur <= prev:
            raise ValueError(
                f"{_K_SPLIT} = {split_points}: must be strictly increasing (layers.{cur} after layers.{prev}); "
                "equal points would give a stage with no layer"
            )
    for start in starts:
        if not 1 <= start < n_layers:
            raise ValueError(
                f"{_K_SPLIT} = {split_points}: layers.{start} is out of range; the model has {n_layers} layers, "
                f"so a stage may start at layers.1 .. layers.{n_layers - 1}"
            )
    return starts


def _even_bounds(n_layers: int, num_stages: int, why: str) -> list[int]:
    """Stage start layers for an even split; the first n_layers % num_stages stages get one more."""
    if n_layers < num_stages:
        raise ValueError(
            f"cannot split {n_layers} layers into {num_stages} stages ({why}): a stage would have no layer; "
            f"lower {_K_DEGREE}, use a single-stage schedule, or give {_K_SPLIT}"
        )
    base, extra = divmod(n_layers, num_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    return [sum(sizes[:s]) for s in range(1, num_stages)]


def _check_stage_count(num_stages: int, pp: int, schedule: str, split_points: list[str]) -> None:
    if num_stages % pp:
        raise ValueError(
            f"{_K_SPLIT} = {split_points} gives {num_stages} stages, not a multiple of {_K_DEGREE} = {pp}; "
            "every rank must hold the same number of stages"
        )
    if schedule in SINGLE_STAGE_SCHEDULES and num_stages != pp:
        raise ValueError(
            f"{_K_SCHEDULE} = {schedule!r} runs exactly one stage per rank, but {_K_SPLIT} = {split_points} "
            f"gives {num_stages} stages for {_K_DEGREE} = {pp}; use a multi-stage schedule "
            f"{list(MULTI_STAGE_SCHEDULES)} or {pp - 1} split points"
        )
    if _is_v(schedule) and num_stages != 2 * pp:
        raise ValueError(
            f"{_K_SCHEDULE} = {schedule!r} places exactly 2 stages per rank (V shape), but got {num_stages} "
            f"stages for {_K_DEGREE} = {pp}; give {2 * pp - 1} split points in {_K_SPLIT} or none"
        )


def resolve_stage_layout(
    n_layers: int, pp: int, schedule: str, split_points: list[str], csv_path: str
) -> list[tuple[int, int]]:
    """[(first_layer, end_layer)] per stage, in stage order.

    Without split points: an even split into pp stages (single-stage schedules) or 2*pp stages
    (multi-stage, V and CSV schedules). With a CSV, the file is read and checked too.

    Raises:
        ValueError: naming the offending key and value, and what is allowed.
    """
    schedule = _canonical_schedule(schedule, csv_path)
    if split_points:
        starts = _parse_split_points(split_points, n_layers)
    else:
        num_stages = pp if schedule in SINGLE_STAGE_SCHEDULES else 2 * pp
        starts = _even_bounds(n_layers, num_stages, f"{_K_DEGREE} = {pp}, {_K_SCHEDULE} = {schedule!r}")
    bounds = [0, *starts, n_layers]
    _check_stage_count(len(bounds) - 1, pp, schedule, split_points)
    if csv_path:
        _check_csv_placement(csv_path, pp, len(bounds) - 1, schedule)
    return list(zip(bounds[:-1], bounds[1:]))


def stage_ids_for_rank(pp_rank: int, pp: int, num_stages: int, schedule: str) -> list[int]:
    """Loop placement r, r+pp, r+2pp, ...; V placement [r, 2*pp-1-r] for V schedules (or "v")."""
    if _is_v(schedule):
        assert num_stages == 2 * pp, "V placement needs 2 stages per rank"
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, num_stages, pp))


def _read_csv_actions(csv_path: str) -> list[list[_Action]]:
    """The CSV's compute actions, one list per row (rank); ValueError naming the file on any problem."""
    if not os.path.isfile(csv_path):
        raise ValueError(f"{_K_CSV} = {csv_path!r}: no such file")
    rows: list[list[_Action]] = []
    with open(csv_path, newline="") as f:
        for line, row in enumerate(csv.reader(f), start=1):
            actions = []
            for cell in row:
                try:
                    action = _Action.from_str(cell)
                except (RuntimeError, ValueError) as e:
                    raise ValueError(f"{_K_CSV} = {csv_path!r}, row {line}: cannot parse {cell!r}: {e}") from e
                if action is None:
                    continue
                if not action.is_compute_op or action.sub_actions is not None:
                    raise ValueError(
                        f"{_K_CSV} = {csv_path!r}, row {line}: {cell!r} is not a compute action; the file must "
                        "hold only F/B/I/W actions like 0F0, 1B3 (torch adds the sends and receives)"
                    )
                actions.append(action)
            rows.append(actions)
    return rows


def _check_csv_placement(csv_path: str, pp: int, num_stages: int, placement: str) -> None:
    rows = _read_csv_actions(csv_path)
    if len(rows) != pp:
        raise ValueError(f"{_K_CSV} = {csv_path!r} has {len(rows)} rows; it needs one per rank ({_K_DEGREE} = {pp})")
    for rank, actions in enumerate(rows):
        expected = set(stage_ids_for_rank(rank, pp, num_stages, placement))
        found = {a.stage_index for a in actions}
        if found != expected:
            raise ValueError(
                f"{_K_CSV} = {csv_path!r}: row {rank + 1} (rank {rank}) runs stages {sorted(found)}, but "
                f"{num_stages} stages with {placement!r} placement ({_K_SCHEDULE}) put {sorted(expected)} there"
            )


def validate_microbatches(
    schedule: str, n_microbatches: int, local_batch_size: int, num_stages: int, pp: int
) -> None:
    """Raise ValueError before torch does, for the constraints torch 2.13's schedules enforce."""
    where = f"{_K_MB} = {n_microbatches}"
    if n_microbatches < 1:
        raise ValueError(f"{where}: must be >= 1")
    if local_batch_size % n_microbatches:
        raise ValueError(
            f"{where} does not divide the local batch (training.batch_size = {local_batch_size} per data-parallel "
            "rank); pick a divisor of it"
        )
    name = schedule.lower()
    if name in ("1f1b", "dualpipev") and n_microbatches < num_stages:
        raise ValueError(
            f"{where} with {_K_SCHEDULE} = {schedule!r}: needs at least as many microbatches as stages "
            f"({num_stages}); raise it (training.batch_size must stay divisible by it)"
        )
    if name in ("interleaved1f1b", "interleavedzerobubble"):
        rounds = max(1, n_microbatches // pp)  # torch runs the microbatches in rounds of pp
        if n_microbatches % rounds:
            raise ValueError(
                f"{where} with {_K_SCHEDULE} = {schedule!r} and {_K_DEGREE} = {pp}: microbatches run in "
                f"max(1, {n_microbatches} // {pp}) = {rounds} rounds, which must divide them; use a multiple "
                f"of {pp} or fewer than {pp}"
            )


def split_stage_model(whole: nn.Module, first_layer: int, end_layer: int, *, is_first: bool, is_last: bool) -> nn.Module:
    """A deepcopy of the meta model with layers [first_layer, end_layer) and the ends it owns (else None)."""
    part = deepcopy(whole)
    for name in list(part.layers.keys()):
        if not first_layer <= int(name) < end_layer:
            del part.layers[name]
    if not is_first:
        part.tok_embeddings = None
    if not is_last:
        part.norm = None
        part.output = None
    return part


_shape_inference_depth = 0


def in_shape_inference() -> bool:
    """True while a stage runs torch's metadata (shape) inference forward.

    torch 2.13 stages infer their input/output shapes by running the stage once on the first
    ``step`` (later stages on uninitialised tensors). Side effects of that forward, like MoE token
    counts (expert_load.py), must be ignored.
    """
    return _shape_inference_depth > 0


class _Stage(PipelineStage):
    """PipelineStage that marks its shape-inference forward (see ``in_shape_inference``)."""

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any):
        global _shape_inference_depth
        _shape_inference_depth += 1
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            _shape_inference_depth -= 1


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


def _build_schedule(
    stages: list[PipelineStage], schedule: str, csv_path: str, n_microbatches: int, loss_fn: Callable
) -> Any:
    if csv_path:
        runtime = _PipelineScheduleRuntime(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
        try:
            runtime._load_csv(csv_path)
        except (AssertionError, RuntimeError, ValueError, KeyError) as e:
            raise ValueError(f"{_K_CSV} = {csv_path!r} is not a valid schedule for {n_microbatches} microbatches "
                             f"and {stages[0].num_stages} stages: {e}") from e
        return runtime
    cls = get_schedule_class(schedule)
    if schedule in SINGLE_STAGE_SCHEDULES:
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)


def build_pipeline(
    whole: nn.Module,
    *,
    pp_mesh: DeviceMesh,
    device: torch.device,
    n_microbatches: int,
    local_batch_size: int,
    schedule: str,
    split_points: list[str],
    csv_path: str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    finish_stage: Callable[[nn.Module], None],
    release_sent_outputs: bool = True,
) -> PipelineParts:
    """Split the meta-device ``whole`` into this rank's stages, finish each part, and build the schedule.

    ``finish_stage`` applies TP/AC/compile/FSDP, ``to_empty`` and init to one part in place.
    ``release_sent_outputs`` (GPipe only) frees each stage output once sent; see _OutputReleasingStage.
    """
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    layout = resolve_stage_layout(whole.args.n_layers, pp, schedule, split_points, csv_path)
    canonical = _canonical_schedule(schedule, csv_path)
    num_stages = len(layout)
    validate_microbatches(canonical, n_microbatches, local_batch_size, num_stages, pp)
    stage_cls = _OutputReleasingStage if release_sent_outputs and canonical == "GPipe" else _Stage
    parts, stages = [], []
    for stage_id in stage_ids_for_rank(pp_rank, pp, num_stages, canonical):
        first, end = layout[stage_id]
        part = split_stage_model(whole, first, end, is_first=stage_id == 0, is_last=stage_id == num_stages - 1)
        finish_stage(part)
        parts.append(part)
        stages.append(stage_cls(part, stage_id, num_stages, device, group=pp_mesh.get_group()))
        logger.info("pp rank %d: stage %d of %d holds layers %d..%d", pp_rank, stage_id, num_stages, first, end - 1)
    return PipelineParts(
        schedule=_build_schedule(stages, canonical, csv_path, n_microbatches, loss_fn),
        model_parts=parts,
        stages=stages,
        has_first_stage=any(s.is_first for s in stages),
        has_last_stage=any(s.is_last for s in stages),
    )


def pipeline_step(parts: PipelineParts, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """One forward + backward over the whole local batch; the mean microbatch loss on last-stage ranks.

    Gradients are those of the mean loss over the batch (schedules scale by 1/n_microbatches).
    """
    args = (inputs,) if parts.has_first_stage else ()
    target = labels if parts.has_last_stage else None
    losses: list[torch.Tensor] | None = [] if parts.has_last_stage else None
    # return_outputs=False: the last stage would otherwise keep every microbatch's logits
    parts.schedule.step(*args, target=target, losses=losses, return_outputs=False)
    for stage in parts.stages:
        if isinstance(stage, _OutputReleasingStage):
            stage.finish_sends()
    return torch.stack(losses).mean() if losses is not None else None
