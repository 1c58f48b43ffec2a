"""Float8 training runs (torchao, on CPU: ``torch._scaled_mm`` runs there): parity, curve, resume.

* Matrix rows (worker-pool jobs like tests/runs/training/test_parity_matrix.py's): each float8 layout against the
  single-process float8 run with the matrix's settings (fp32 master weights, float8 GEMMs).
* Resume: float8 (FSDP2, float8 all-gather) 4 steps then to 8 = uninterrupted, bit-exact; a float8
  checkpoint resumes without float8 and the reverse; both checkpoints hold the same keys and dtypes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.support.matrix import MOE, RTOL, MatrixLaunches, Row, check_grad_norms, check_row, job_argv, losses_of
from tests.support.rows import FLOAT8, FLOAT8_ROWS, FSDP_FLOAT8
from tests.support.runs import GLOBAL_BATCH, ROOT, check_job, launch_jobs, step_losses, tensor_metadata, train

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2)]

ROWWISE = [*FLOAT8, "--float8.recipe_name", "rowwise"]

MOE_FLOAT8_ROWS = [Row("moe_float8_fsdp2", 2, 4, [*MOE, *FSDP_FLOAT8])]
# Tensorwise scales of activations and output gradients come from the tensor a rank holds: its local
# batch under FSDP (4 of the 8 samples), its micro-batch under PP (2), the whole batch under TP
# (DTensor amax). A different amax moves the float8 grid, so the GEMMs round differently (e4m3: 3
# mantissa bits): layouts differ by float8 rounding noise, not fp32's 1e-7. Measured max relative gap
# over the 6 steps on the tiny parity flavor: fsdp2 1.5e-4, fsdp2_tp2 1.3e-4, pp2 4.5e-5, moe_fsdp2
# 2.6e-5, async_tp2 5.7e-6, tp2 6.8e-7 (on the debug flavor: 3.5e-4 at most). 1e-3 is ~7x the largest;
# each row must also miss the fp32 run by more than RTOL (measured: 1.9e-4 at least, fsdp2).
FLOAT8_RTOL = 1e-3
# Grad norms: measured max relative gap to the float8 reference 1.4e-3 (fsdp2_tp2), 1.3e-3 fsdp2, 1.1e-3
# moe_fsdp2, 2.9e-4 pp2, 1.8e-4 tp2; 4e-3 is 2.9x the largest (a norm counted twice is 41 % off).
FLOAT8_GRAD_NORM_RTOL = 4e-3


def _single_process(tmp_path_factory, name: str, overrides: list[str]) -> dict[str, list[float]]:
    folder = str(tmp_path_factory.mktemp(name))
    result = train(1, folder, ["--training.batch_size", str(GLOBAL_BATCH), *overrides])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "linears converted" in result.stdout + result.stderr  # the conversion's log line
    return losses_of(folder)


@pytest.fixture(scope="session")
def float8_reference(tmp_path_factory) -> dict[str, list[float]]:
    return _single_process(tmp_path_factory, "float8_reference", FLOAT8)


@pytest.fixture(scope="session")
def moe_float8_reference(tmp_path_factory) -> dict[str, list[float]]:
    return _single_process(tmp_path_factory, "moe_float8_reference", [*MOE, *FLOAT8])


def _gaps(got: list[float], want: list[float]) -> list[float]:
    return [abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)]


@pytest.mark.parametrize("row", FLOAT8_ROWS, ids=[r.name for r in FLOAT8_ROWS])
def test_float8_loss_parity(row: Row, float8_reference: dict, reference: dict, matrix: MatrixLaunches):
    check_row(row)
    records = matrix.losses(row)
    losses = records["loss"]
    gaps = _gaps(losses, float8_reference["loss"])
    print(row.name, "gap to float8 reference", [f"{g:.2e}" for g in gaps])
    assert max(gaps) <= FLOAT8_RTOL, f"{row.name}: {losses} vs single-process float8 {float8_reference['loss']}"
    check_grad_norms(row.name, records["grad_norm"], float8_reference["grad_norm"], FLOAT8_GRAD_NORM_RTOL)
    _check_converted(matrix, row, reference["loss"], losses)


def _check_converted(matrix: MatrixLaunches, row: Row, fp32: list[float], losses: list[float]) -> None:
    """The run said it converted its linears, and its losses are not the fp32 run's."""
    assert "linears converted" in matrix.run(row)
    assert max(_gaps(losses, fp32)) > RTOL, f"{row.name} is within fp32 parity of the fp32 run: not float8?"


@pytest.mark.parametrize("row", MOE_FLOAT8_ROWS, ids=[r.name for r in MOE_FLOAT8_ROWS])
def test_moe_float8_loss_parity(row: Row, moe_float8_reference: dict, matrix: MatrixLaunches):
    check_row(row)
    records = matrix.losses(row)
    losses = records["loss"]
    gaps = _gaps(losses, moe_float8_reference["loss"])
    print(row.name, "gap to float8 reference", [f"{g:.2e}" for g in gaps])
    assert max(gaps) <= FLOAT8_RTOL, f"{row.name}: {losses} vs single-process float8 {moe_float8_reference['loss']}"
    check_grad_norms(row.name, records["grad_norm"], moe_float8_reference["grad_norm"], FLOAT8_GRAD_NORM_RTOL)
    assert "linears converted" in matrix.run(row)


# --------------------------------------------------------------------------------------------- resume
RESUME = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "4", "--training.steps", "8"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]


def _resume_job(folder: str, *extra: str) -> list[str]:
    return [*job_argv(Row("resume", 2, 4), folder), *RESUME, *extra]


@pytest.mark.bf16  # one 4-step resume in bf16
def test_float8_resume_is_bit_exact_and_interchanges_with_bf16(tmp_path):
    """FSDP2 x 2 with the float8 all-gather (FSDP's DTensors hold torchao's float8-cast weight subclasses).

    8 steps saving at 4 and 8, float8 and not; then from step 4: float8 again (steps 5-8 bit-exact), the
    float8 checkpoint in bf16 without float8, and the plain checkpoint in float8.
    """
    f = {n: str(tmp_path / n) for n in ("float8", "plain", "float8_again", "float8_in_bf16", "plain_in_float8")}
    launch = launch_jobs(2, [_resume_job(f["float8"], *FSDP_FLOAT8), _resume_job(f["plain"])], str(tmp_path / "a.json"))
    for name in ("float8", "plain"):
        check_job(name, f[name], launch)
    step4 = {n: os.path.join(f[n], "checkpoint", "step-4") for n in ("float8", "plain")}
    assert tensor_metadata(step4["float8"]) == tensor_metadata(step4["plain"]), (
        "a float8 checkpoint must hold the same keys/dtypes"
    )
    for copy, source in (("float8_again", "float8"), ("float8_in_bf16", "float8"), ("plain_in_float8", "plain")):
        shutil.copytree(f[source], f[copy])
    load4 = ["--checkpoint.load_step", "4"]
    jobs = [
        _resume_job(f["float8_again"], *FSDP_FLOAT8, *load4),
        _resume_job(f["float8_in_bf16"], *BF16, *load4),
        _resume_job(f["plain_in_float8"], *FSDP_FLOAT8, *load4),
    ]
    launch = launch_jobs(2, jobs, str(tmp_path / "b.json"))
    for name in ("float8_again", "float8_in_bf16", "plain_in_float8"):
        assert "resumed from step 4" in check_job(name, f[name], launch)
    losses = {n: step_losses(folder) for n, folder in f.items()}
    assert [losses["float8_again"][s] for s in range(5, 9)] == [losses["float8"][s] for s in range(5, 9)]
    # From the same step-4 weights, one step in another precision: within float8 rounding of the source run
    # at step 5 (measured 7.6e-5 and 6.0e-5 relative; limit 1e-3), far from a fresh init's 8.18 (15% off).
    for name, source in (("float8_in_bf16", "float8"), ("plain_in_float8", "plain")):
        assert abs(losses[name][5] - losses[source][5]) <= 1e-3 * losses[source][5], (
            name,
            losses[name],
            losses[source],
        )
        assert losses[name][5] != losses[source][5], f"{name}: the precision did not change"


def test_torchao_import_leaves_the_users_output_alone():
    """Importing torchao (the first float8 run of a process) logs nothing the user did not ask about: not its
    CUDA kernels failing to load, "no triton", or torch's deprecation of its enums. A fresh process: torchao
    says these once, at its first import. Another torchao warning still gets through."""
    code = (
        "import logging, sys, torch\n"
        "from torchtitan.observability.logging import init_logger\n"
        "init_logger()\n"
        "from torchtitan.features.float8.float8 import check_float8_runs\n"
        "check_float8_runs(torch.device('cpu'))\n"
        "import torchao.prototype.moe_training\n"
        "assert 'torchao.float8' in sys.modules\n"
        "logging.getLogger('torchao').warning('a torchao warning of its own')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    for noise in ("Failed to load", "Detected no triton", "register_constant"):
        assert noise not in output, output[-3000:]
    assert "a torchao warning of its own" in output
