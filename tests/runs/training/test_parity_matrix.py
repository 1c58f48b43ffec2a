"""The loss-parity matrix: torchrun runs of the debug model through run_llama_train.sh.

Each row trains the same global batch (8 samples x 64 tokens per optimizer step) for STEPS steps
under a different parallel layout, and its per-step global losses must equal those of the
single-process run. (Validation-loss parity across layouts: tests/runs/launch/test_run_experience.py.) That holds because weights are a function of the seed (not of the layout)
and global batch k holds the same samples whatever the data-parallel degree.

Tolerance: relative 1e-5 per step in fp32 (RTOL). Layouts differ only in the order of the
floating-point reductions (FSDP's reduce-scatter vs. one process's sum), ~1e-7 relative per step.

Golden values (tests/support/golden.py): every row's and reference's logged numbers must also equal, bit for bit,
those recorded on a machine like this one in tests/assets/golden_parity.json (within the tolerances above
elsewhere); TORCHTITAN_GOLDEN_RECORD=PATH records them.
"""

from __future__ import annotations

import os

import pytest

from tests.support.golden import GoldenCheck, values_of
from tests.support.matrix import (
    BF16_GRAD_NORM_RTOL,
    BF16_ROWS,
    BF16_RTOL,
    BF16_TOLERANCE,
    DOC_MOE_ROWS,
    DOC_ROWS,
    FP32_TOLERANCE,
    FUSED_RMSNORM,
    GRAD_NORM_RTOL,
    MOE_ROWS,
    PURE_BF16_GRAD_NORM_RTOL,
    PURE_BF16_ROWS,
    PURE_BF16_RTOL,
    PURE_BF16_TOLERANCE,
    ROWS,
    RTOL,
    MatrixLaunches,
    Row,
    check_grad_norms,
    check_row,
    losses_of,
    stored_dtypes,
)
from tests.support.runs import GLOBAL_BATCH, PARITY_FLAVOR, STEPS, VAL_FREQ, VALIDATION, read_metrics, train

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("row", MOE_ROWS, ids=[r.name for r in MOE_ROWS])
def test_moe_loss_parity(row: Row, moe_reference_run, matrix: MatrixLaunches, golden: GoldenCheck):
    check_row(row)
    losses = matrix.losses(row)
    golden.check(row.name, values_of(losses, VAL_FREQ), FP32_TOLERANCE)
    ref_folder, _ = moe_reference_run
    reference = read_metrics(ref_folder)
    for i, (got, want) in enumerate(zip(losses["loss"], [r["loss"] for r in reference], strict=True)):
        assert abs(got - want) <= RTOL * abs(want), f"loss #{i}: {row.name} {got} vs single-process {want}"
    # the expert bias follows the global counts, so routing (and the logged load) is layout-invariant
    for got, want in zip(read_metrics(matrix.folder(row)), reference, strict=True):
        assert got["expert_load"] == want["expert_load"], f"step {want['step']}: expert load differs"
        assert abs(got["grad_norm"] - want["grad_norm"]) <= GRAD_NORM_RTOL * want["grad_norm"], (got, want)


def test_moe_reference_learns_and_logs_expert_load(moe_reference_run):
    folder, result = moe_reference_run
    records = read_metrics(folder)
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.3, f"MoE loss did not fall: {losses}"
    from torchtitan.models.moe import moe_configs

    args = moe_configs[PARITY_FLAVOR]
    moe_layers = [f"layers.{i}" for i in range(args.first_k_dense, args.n_layers)]  # layer 0 dense, the rest MoE
    assert len(moe_layers) >= 3 and args.num_experts >= 4
    tokens_per_step = GLOBAL_BATCH * 64 * args.top_k  # every token picks top_k experts
    for r in records:
        assert sorted(r["expert_load"]) == sorted(moe_layers)
        for name, load in r["expert_load"].items():
            assert len(load) == args.num_experts and sum(load) == tokens_per_step, (name, load)
            assert r["expert_imbalance"][name] == pytest.approx(max(load) / (sum(load) / args.num_experts))
        assert r["expert_imbalance_max"] == max(r["expert_imbalance"].values())
    assert "moe_imbalance" in result.stdout + result.stderr  # the step line's short mention


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_loss_parity(row: Row, reference: dict[str, list[float]], matrix: MatrixLaunches, golden: GoldenCheck):
    check_row(row)
    losses = matrix.losses(row)
    golden.check(row.name, values_of(losses, VAL_FREQ), FP32_TOLERANCE)
    for key in ("loss",):
        for i, (got, want) in enumerate(zip(losses[key], reference[key], strict=True)):
            assert abs(got - want) <= RTOL * abs(want), f"{key} #{i}: {row.name} {got} vs single-process {want}"
    check_grad_norms(row.name, losses["grad_norm"], reference["grad_norm"], GRAD_NORM_RTOL)


@pytest.mark.bf16
@pytest.mark.parametrize("row", BF16_ROWS, ids=[r.name for r in BF16_ROWS])
def test_bf16_loss_parity(row: Row, bf16_reference: dict, reference: dict, matrix: MatrixLaunches, golden: GoldenCheck):
    check_row(row)
    records = matrix.losses(row)
    golden.check(row.name, values_of(records, VAL_FREQ), BF16_TOLERANCE)
    losses = records["loss"]
    check_grad_norms(row.name, records["grad_norm"], bf16_reference["grad_norm"], BF16_GRAD_NORM_RTOL)
    for i, (got, want) in enumerate(zip(losses, bf16_reference["loss"], strict=True)):
        assert abs(got - want) <= BF16_RTOL * abs(want), f"loss #{i}: {row.name} {got} vs single-process bf16 {want}"
    gap_to_fp32 = max(abs(got - want) / abs(want) for got, want in zip(losses, reference["loss"], strict=True))
    assert gap_to_fp32 > RTOL, f"{row.name} is within fp32 parity ({gap_to_fp32:.2g}) of the fp32 run: not bf16?"


@pytest.mark.bf16
@pytest.mark.parametrize("row", PURE_BF16_ROWS, ids=[r.name for r in PURE_BF16_ROWS])
def test_pure_bf16_loss_parity(row: Row, pure_bf16_reference: dict, matrix: MatrixLaunches, golden: GoldenCheck):
    check_row(row)
    records = matrix.losses(row)
    golden.check(row.name, values_of(records, VAL_FREQ), PURE_BF16_TOLERANCE)
    check_grad_norms(row.name, records["grad_norm"], pure_bf16_reference["grad_norm"], PURE_BF16_GRAD_NORM_RTOL)
    for i, (got, want) in enumerate(zip(records["loss"], pure_bf16_reference["loss"], strict=True)):
        assert abs(got - want) <= PURE_BF16_RTOL * abs(want), f"loss #{i}: {row.name} {got} vs pure bf16 {want}"
    assert stored_dtypes(os.path.join(matrix.folder(row), "checkpoint", f"step-{STEPS}")) == {"bfloat16"}


@pytest.mark.parametrize("row", DOC_ROWS + DOC_MOE_ROWS, ids=[r.name for r in DOC_ROWS + DOC_MOE_ROWS])
def test_block_causal_loss_parity(row: Row, docs_reference, docs_moe_reference, matrix: MatrixLaunches, golden):
    check_row(row)
    losses = matrix.losses(row)
    golden.check(row.name, values_of(losses, VAL_FREQ), FP32_TOLERANCE)
    reference = docs_moe_reference if row in DOC_MOE_ROWS else docs_reference
    for key in ("loss", "validation_loss"):
        for i, (got, want) in enumerate(zip(losses[key], reference[key], strict=True)):
            assert abs(got - want) <= RTOL * abs(want), f"{key} #{i}: {row.name} {got} vs single-process {want}"
    check_grad_norms(row.name, losses["grad_norm"], reference["grad_norm"], GRAD_NORM_RTOL)
    # the same windows, so the same documents: a function of the global batch, not of the layout
    docs = [r["documents_per_window"] for r in read_metrics(matrix.folder(row)) if "loss" in r]
    assert docs == reference["documents_per_window"], (docs, reference["documents_per_window"])


def test_fused_rmsnorm_one_process_equals_rmsnorm(reference: dict[str, list[float]], tmp_path):
    folder = str(tmp_path / "fused_rmsnorm")
    result = train(1, folder, ["--training.batch_size", str(GLOBAL_BATCH), *VALIDATION, *FUSED_RMSNORM])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "aten::_fused_rms_norm" in result.stdout + result.stderr  # the one line saying what it runs
    assert losses_of(folder)["loss"] == reference["loss"]


# The single-process references' own golden values (tests/support/golden.py): the runs are the fixtures' (no new run).
REFERENCES = [
    "reference",
    pytest.param("bf16_reference", marks=pytest.mark.bf16),
    pytest.param("pure_bf16_reference", marks=pytest.mark.bf16),
    "moe_reference_run",
    "docs_reference",
    "docs_moe_reference",
]


@pytest.mark.pool(1)
@pytest.mark.parametrize("fixture", REFERENCES)
def test_reference_golden(fixture: str, request: pytest.FixtureRequest, golden: GoldenCheck):
    value = request.getfixturevalue(fixture)
    losses = losses_of(value[0]) if fixture == "moe_reference_run" else value  # (dump folder, its run)
    tolerance = {"bf16_reference": BF16_TOLERANCE, "pure_bf16_reference": PURE_BF16_TOLERANCE}.get(
        fixture, FP32_TOLERANCE
    )
    golden.check(fixture.removesuffix("_run"), values_of(losses, VAL_FREQ), tolerance)
