"""Pipeline stage layout: which layers each stage holds and which stages each pp rank runs.

Stages split ``layers`` into contiguous ranges: an even split into pp stages (single-stage
schedules) or 2*pp (multi-stage schedules), or at ``pipeline_parallel_split_points``. Each rank
holds one stage (single-stage schedules) or several: stage s on rank s % pp ("loop"), or, for the
V schedules, stages r and 2*pp-1-r on rank r, so rank 0 holds both the first and the last stage.

A custom schedule can be read from a CSV file of compute-only actions, one row per pp rank, e.g.
``0F0,0F1,0B0,0B1`` (stage, F/B/I/W, microbatch); torch adds the sends and receives. With a CSV,
``pipeline_parallel_schedule`` names the stage placement the CSV was written for: "loop" (any
non-V schedule name, such as the default "1F1B", means loop) or "v" (also "ZBVZeroBubble",
"DualPipeV"). The CSV's rows must place the stages that way; we check it.

Pure bookkeeping (no process group): the pre-launch config check and the estimator use it too.
"""

from __future__ import annotations

import csv
import os
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _Action

    from torchtitan.config.schema import Experimental, Model, Training

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
# torchtitan's spelling with a CSV: the schedule class, which says how many stages a rank runs
# ("single": one stage per rank, an internal placement name).
CSV_CLASS_NAMES: dict[str, str] = {"PipelineScheduleMulti": "loop", "PipelineScheduleSingle": "single"}

_SPLIT_RE = re.compile(r"layers\.(\d+)")
_K_SPLIT = "experimental.pipeline_parallel_split_points"
_K_DEGREE = "experimental.pipeline_parallel_degree"
_K_SCHEDULE = "experimental.pipeline_parallel_schedule"
_K_CSV = "experimental.pipeline_parallel_schedule_csv"
_K_MB = "experimental.pipeline_parallel_microbatches"


def canonical_schedule(schedule: str, csv_path: str) -> str:
    """The schedule's canonical spelling (case-insensitive, like torch); with a CSV, the stage
    placement: "loop", "v" or (PipelineScheduleSingle) "single", one stage per rank."""
    names = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES
    by_lower = {n.lower(): n for n in names}
    canonical = by_lower.get(schedule.lower())
    if csv_path:
        classes = {k.lower(): v for k, v in CSV_CLASS_NAMES.items()}
        if schedule.lower() in CSV_PLACEMENTS:
            return schedule.lower()
        if schedule.lower() in classes:
            return classes[schedule.lower()]
        if canonical is not None:
            return "v" if canonical in V_SCHEDULES else "loop"
        raise ValueError(
            f"{_K_SCHEDULE} = {schedule!r} with {_K_CSV} = {csv_path!r}: with a CSV schedule it names the "
            f"stage placement; allowed: {list(CSV_PLACEMENTS)}, a schedule class {list(CSV_CLASS_NAMES)} or a "
            f"schedule name {list(names)}"
        )
    if canonical is None:
        raise ValueError(f"{_K_SCHEDULE} = {schedule!r} is unknown; valid schedules: {list(names)}")
    return canonical


def _one_stage_per_rank(schedule: str) -> bool:
    """A single-stage schedule, or a CSV written for one stage per rank ("single")."""
    return schedule in SINGLE_STAGE_SCHEDULES or schedule == "single"


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
    if _one_stage_per_rank(schedule) and num_stages != pp:
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
    schedule = canonical_schedule(schedule, csv_path)
    if split_points:
        starts = _parse_split_points(split_points, n_layers)
    else:
        num_stages = pp if _one_stage_per_rank(schedule) else 2 * pp
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
    # Imported here: torch.distributed.pipelining pulls in dynamo (over a second), and this module
    # is part of the pre-launch config check, which reads a CSV only for CSV schedules.
    from torch.distributed.pipelining.schedules import _Action

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


SPLIT_BACKWARD_SCHEDULES: tuple[str, ...] = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def splits_backward(schedule: str, csv_path: str) -> bool:
    """Whether the schedule computes weight gradients apart from input gradients (zero-bubble "I"/"W"
    actions): those weight gradients are assigned by the schedule, not accumulated by autograd."""
    if csv_path:
        return any(a.computation_type.value in ("I", "W") for row in _read_csv_actions(csv_path) for a in row)
    return canonical_schedule(schedule, csv_path) in SPLIT_BACKWARD_SCHEDULES


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


def validate_microbatches(schedule: str, n_microbatches: int, local_batch_size: int, num_stages: int, pp: int) -> None:
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


def check_pipeline(args: Any, *, model: Model, training: Training, experimental: Experimental) -> None:
    """Pre-launch: the flavor's stage split and the micro-batches, checked here so the user sees our message, not
    torch's. Called by the model check (spec.check_model), which knows the flavor's ``args``."""
    exp = experimental
    pp = exp.pipeline_parallel_degree
    if pp == 1:
        return
    if getattr(args, "tie_word_embeddings", False):
        raise NotImplementedError(
            f"model.flavor = {model.flavor!r} ties the output head to the embedding table, and "
            f"{_K_DEGREE} = {pp} puts them on different stages (the first and the "
            "last), where one parameter cannot get both gradients; use pipeline_parallel_degree = 1 with this "
            "flavor"
        )
    if exp.pipeline_parallel_schedule_csv and not os.path.isfile(exp.pipeline_parallel_schedule_csv):
        raise FileNotFoundError(f"{_K_CSV} = '{exp.pipeline_parallel_schedule_csv}' does not exist")
    stages = resolve_stage_layout(
        args.n_layers,
        pp,
        exp.pipeline_parallel_schedule,
        exp.pipeline_parallel_split_points,
        exp.pipeline_parallel_schedule_csv,
    )
    n_microbatches = exp.pipeline_parallel_microbatches or pp
    validate_microbatches(exp.pipeline_parallel_schedule, n_microbatches, training.batch_size, len(stages), pp)
