"""Pipeline stage layout, placement, microbatch checks and stage splitting (no processes)."""

from __future__ import annotations

import pytest
import torch

from torchtitan.distributed.pipeline.layout import (
    MULTI_STAGE_SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    resolve_stage_layout,
    stage_ids_for_rank,
    validate_microbatches,
)
from torchtitan.distributed.pipeline.stages import prune_to_stage
from torchtitan.models import ModelArgs
from torchtitan.models.llama.model import Transformer


def _csv(tmp_path, rows: list[str]) -> str:
    path = tmp_path / "schedule.csv"
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_schedule_name_lists():
    assert set(V_SCHEDULES) <= set(MULTI_STAGE_SCHEDULES)
    assert not set(SINGLE_STAGE_SCHEDULES) & set(MULTI_STAGE_SCHEDULES)


@pytest.mark.parametrize(
    "schedule, expected",
    [
        ("1F1B", [(0, 4), (4, 8)]),
        ("GPipe", [(0, 4), (4, 8)]),
        ("gpipe", [(0, 4), (4, 8)]),  # case-insensitive, like torch
        ("Interleaved1F1B", [(0, 2), (2, 4), (4, 6), (6, 8)]),
        ("ZBVZeroBubble", [(0, 2), (2, 4), (4, 6), (6, 8)]),
    ],
)
def test_even_split_of_8_layers_at_pp2(schedule, expected):
    assert resolve_stage_layout(8, 2, schedule, [], "") == expected


def test_uneven_auto_split_gives_extra_layers_to_the_first_stages():
    assert resolve_stage_layout(7, 2, "1F1B", [], "") == [(0, 4), (4, 7)]


def test_explicit_split_points():
    assert resolve_stage_layout(8, 2, "1F1B", ["layers.3"], "") == [(0, 3), (3, 8)]
    layout = resolve_stage_layout(8, 2, "LoopedBFS", ["layers.1", "layers.4", "layers.6"], "")
    assert layout == [(0, 1), (1, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize(
    "n_layers, pp, schedule, split_points, match",
    [
        (8, 2, "1F1B", ["layer.4"], r"pipeline_parallel_split_points.*'layer\.4' is not of the form 'layers\.N'"),
        (8, 2, "1F1B", ["layers.x"], r"not of the form"),
        (8, 4, "1F1B", ["layers.4", "layers.2", "layers.6"], r"strictly increasing"),
        (8, 4, "1F1B", ["layers.2", "layers.2", "layers.6"], r"strictly increasing.*no layer"),
        (8, 2, "1F1B", ["layers.8"], r"layers\.8 is out of range; the model has 8 layers"),
        (8, 2, "1F1B", ["layers.0"], r"out of range"),
        (8, 2, "LoopedBFS", ["layers.2", "layers.4"], r"3 stages, not a multiple of .*pipeline_parallel_degree = 2"),
        (8, 2, "1F1B", ["layers.2", "layers.4", "layers.6"], r"'1F1B' runs exactly one stage per rank"),
        (12, 2, "ZBVZeroBubble", [f"layers.{i}" for i in (2, 4, 6, 8, 10)], r"exactly 2 stages per rank"),
        (3, 2, "Interleaved1F1B", [], r"cannot split 3 layers into 4 stages.*no layer"),
        (8, 2, "Bogus", [], r"pipeline_parallel_schedule = 'Bogus' is unknown; valid schedules: \[.*'GPipe'"),
    ],
)
def test_layout_errors(n_layers, pp, schedule, split_points, match):
    with pytest.raises(ValueError, match=match):
        resolve_stage_layout(n_layers, pp, schedule, split_points, "")


def test_loop_placement():
    assert stage_ids_for_rank(0, 2, 2, "1F1B") == [0]
    assert stage_ids_for_rank(1, 2, 4, "Interleaved1F1B") == [1, 3]
    assert stage_ids_for_rank(2, 4, 12, "LoopedBFS") == [2, 6, 10]


def test_v_placement():
    assert stage_ids_for_rank(0, 2, 4, "ZBVZeroBubble") == [0, 3]
    assert stage_ids_for_rank(1, 2, 4, "DualPipeV") == [1, 2]
    assert stage_ids_for_rank(3, 4, 8, "v") == [3, 4]


def test_csv_layout_and_placement(tmp_path):
    loop = _csv(tmp_path, ["0F0,2F0,2B0,0B0", "1F0,3F0,3B0,1B0"])
    assert resolve_stage_layout(8, 2, "loop", [], loop) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert resolve_stage_layout(8, 2, "1F1B", [], loop) == [(0, 2), (2, 4), (4, 6), (6, 8)]  # non-V name: loop
    v = _csv(tmp_path, ["0F0,3F0,3B0,0B0", "1F0,2F0,2B0,1B0"])
    assert len(resolve_stage_layout(8, 2, "v", [], v)) == 4
    with pytest.raises(ValueError, match=r"row 1 \(rank 0\) runs stages \[0, 3\].*'loop' placement.*\[0, 2\]"):
        resolve_stage_layout(8, 2, "loop", [], v)


@pytest.mark.parametrize(
    "rows, match",
    [
        (["0F0,2X0", "1F0"], r"row 1: cannot parse '2X0'"),
        (["0F0,0SEND_F0", "1F0"], r"'0SEND_F0' is not a compute action"),
        (["0F0,2F0"], r"has 1 rows; it needs one per rank"),
    ],
)
def test_csv_errors(tmp_path, rows, match):
    with pytest.raises(ValueError, match=r"pipeline_parallel_schedule_csv = '.*schedule\.csv'.*" + match):
        resolve_stage_layout(8, 2, "loop", [], _csv(tmp_path, rows))


def test_csv_missing_file_and_bad_placement_name(tmp_path):
    with pytest.raises(ValueError, match=r"pipeline_parallel_schedule_csv = '.*nope\.csv': no such file"):
        resolve_stage_layout(8, 2, "loop", [], str(tmp_path / "nope.csv"))
    with pytest.raises(ValueError, match=r"names the stage placement; allowed: \['loop', 'v'\]"):
        resolve_stage_layout(8, 2, "diagonal", [], str(tmp_path / "nope.csv"))


@pytest.mark.parametrize(
    "schedule, n_mb, batch, num_stages, pp, match",
    [
        ("GPipe", 3, 8, 2, 2, r"pipeline_parallel_microbatches = 3 does not divide .*training\.batch_size = 8"),
        ("GPipe", 0, 8, 2, 2, r"must be >= 1"),
        ("1F1B", 2, 8, 4, 4, r"at least as many microbatches as stages \(4\)"),
        ("DualPipeV", 2, 8, 4, 2, r"'DualPipeV'.*at least as many microbatches as stages \(4\)"),
        # torch runs max(1, 9 // 4) = 2 rounds, which must divide the 9 microbatches
        ("Interleaved1F1B", 9, 18, 8, 4, r"'Interleaved1F1B'.*max\(1, 9 // 4\) = 2 rounds, which must divide them"),
    ],
)
def test_microbatch_errors(schedule, n_mb, batch, num_stages, pp, match):
    with pytest.raises(ValueError, match=match):
        validate_microbatches(schedule, n_mb, batch, num_stages, pp)


@pytest.mark.parametrize(
    "schedule, n_mb, num_stages, pp",
    [
        ("GPipe", 1, 2, 2),
        ("1F1B", 4, 4, 4),
        ("Interleaved1F1B", 3, 8, 4),
        ("InterleavedZeroBubble", 8, 8, 4),
        ("ZBVZeroBubble", 2, 4, 2),
        ("DualPipeV", 4, 4, 2),
        ("LoopedBFS", 1, 4, 2),
    ],
)
def test_valid_microbatches(schedule, n_mb, num_stages, pp):
    validate_microbatches(schedule, n_mb, 24, num_stages, pp)


def _tiny_meta() -> Transformer:
    with torch.device("meta"):
        return Transformer(ModelArgs(dim=16, n_layers=8, n_heads=2, vocab_size=32, multiple_of=16, max_seq_len=8))


def test_prune_to_stage_keeps_layer_keys_and_ends():
    whole, first, middle, last = _tiny_meta(), _tiny_meta(), _tiny_meta(), _tiny_meta()
    prune_to_stage(first, 0, 4, True, False)
    prune_to_stage(middle, 4, 6, False, False)
    prune_to_stage(last, 6, 8, False, True)
    assert list(first.layers.keys()) == ["0", "1", "2", "3"]
    assert list(middle.layers.keys()) == ["4", "5"]
    assert list(last.layers.keys()) == ["6", "7"]
    assert first.tok_embeddings is not None and first.norm is None and first.output is None
    assert middle.tok_embeddings is None and middle.norm is None and middle.output is None
    assert last.tok_embeddings is None and last.norm is not None and last.output is not None
    assert len(whole.layers) == 8 and whole.tok_embeddings is not None  # each stage is its own build
    assert all(p.is_meta for p in middle.parameters())
    # names match the whole model's, so checkpoints and init seeds line up
    whole_names = {n for n, _ in whole.named_parameters()}
    assert {n for n, _ in middle.named_parameters()} <= whole_names


def test_csv_accepts_torchtitans_schedule_class_names(tmp_path):
    """With a CSV, PipelineScheduleMulti means the loop placement, PipelineScheduleSingle one stage per rank."""
    multi = _csv(tmp_path, ["0F0,2F0,2B0,0B0", "1F0,3F0,3B0,1B0"])
    assert resolve_stage_layout(8, 2, "PipelineScheduleMulti", [], multi) == resolve_stage_layout(
        8, 2, "loop", [], multi
    )
    single = str(tmp_path / "single.csv")
    with open(single, "w") as f:
        f.write("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    assert resolve_stage_layout(8, 2, "PipelineScheduleSingle", [], single) == [(0, 4), (4, 8)]
    assert stage_ids_for_rank(1, 2, 2, "single") == [1]
    with pytest.raises(ValueError, match=r"row 1 \(rank 0\) runs stages \[0, 2\]"):
        resolve_stage_layout(8, 2, "PipelineScheduleSingle", [], multi)  # a loop CSV is not one stage per rank
