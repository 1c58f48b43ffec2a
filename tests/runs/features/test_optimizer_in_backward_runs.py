"""The optimizer step in backward through the trainer: loss parity on every layout it supports, resume.

* Matrix rows (worker-pool jobs like tests/runs/training/test_parity_matrix.py's): each in-backward layout against the
  single-process run of the regular optimizer, both with ``training.max_norm = 0`` (clipping cannot
  compose with stepping in backward). The update arithmetic is the regular optimizer's on one
  parameter, so the layouts differ only as the regular matrix rows do (RTOL); on one process the
  losses are equal. The grad norm, summed one gradient at a time in the hooks, within GRAD_NORM_RTOL.
* Resume (FSDP2 x 2): in-backward 4 steps then to 8 = uninterrupted, bit-exact; a regular-optimizer
  checkpoint resumes in-backward and the reverse, the continued losses equal the source run's; both
  modes write the same checkpoint keys, shapes and dtypes.
Peak memory against the regular optimizer, and the estimator's row: tests/runs/estimation/test_estimation.py.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support.matrix import GRAD_NORM_RTOL, RTOL, MatrixLaunches, Row, check_row, job_argv
from tests.support.rows import IB, IB_ROWS, NO_CLIP, NO_CLIP_REFERENCE
from tests.support.runs import check_job, launch_jobs, read_metrics, step_losses, tensor_metadata

pytestmark = [pytest.mark.integration, pytest.mark.pool(2)]


def _records(matrix: MatrixLaunches, row: Row) -> list[dict]:
    matrix.losses(row)  # launches the row's world size on first use; checks the job succeeded
    return [r for r in read_metrics(matrix.folder(row)) if "loss" in r]


@pytest.mark.parametrize(("row", "twin"), [(r, NO_CLIP_REFERENCE) for r in IB_ROWS], ids=[r.name for r in IB_ROWS])
def test_in_backward_loss_parity(row: Row, twin: Row, matrix: MatrixLaunches):
    check_row(row)
    got, want = _records(matrix, row), _records(matrix, twin)
    losses, ref = [r["loss"] for r in got], [r["loss"] for r in want]
    gaps = [abs(g - w) / abs(w) for g, w in zip(losses, ref, strict=True)]
    print(row.name, "gap to the regular optimizer", [f"{g:.2e}" for g in gaps])
    if row.ngpu == 1:
        assert losses == ref, f"{row.name}: {losses} vs regular {ref}"
    assert max(gaps) <= RTOL, f"{row.name}: {losses} vs regular {ref}"
    for g, w in zip(got, want, strict=True):
        assert abs(g["grad_norm"] - w["grad_norm"]) <= GRAD_NORM_RTOL * w["grad_norm"], (g, w)
    log = matrix.run(row)
    assert "optimizer steps in backward" in log, "the run did not say it steps in backward"


# --------------------------------------------------------------------------------------------- resume
RESUME = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "4", "--training.steps", "8"]


def _job(folder: str, *extra: str) -> list[str]:
    return [*job_argv(Row("resume", 2, 4), folder), *RESUME, *extra]


def test_in_backward_resume_is_bit_exact_and_interchanges_with_the_regular_optimizer(tmp_path):
    """8 steps saving at 4 and 8 in each mode; from step 4: in-backward again, and each mode from the other's."""
    f = {n: str(tmp_path / n) for n in ("ib", "regular", "ib_again", "regular_in_ib", "ib_in_regular")}
    launch = launch_jobs(2, [_job(f["ib"], *IB), _job(f["regular"], *NO_CLIP)], str(tmp_path / "a.json"))
    for name in ("ib", "regular"):
        check_job(name, f[name], launch)
    step4 = {n: os.path.join(f[n], "checkpoint", "step-4") for n in ("ib", "regular")}
    assert tensor_metadata(step4["ib"]) == tensor_metadata(step4["regular"]), (
        "both modes must write the same checkpoint"
    )
    for copy, source in (("ib_again", "ib"), ("regular_in_ib", "regular"), ("ib_in_regular", "ib")):
        shutil.copytree(f[source], f[copy])
    load4 = ["--checkpoint.load_step", "4"]
    jobs = [_job(f["ib_again"], *IB, *load4), _job(f["regular_in_ib"], *IB, *load4)]
    jobs.append(_job(f["ib_in_regular"], *NO_CLIP, *load4))
    launch = launch_jobs(2, jobs, str(tmp_path / "b.json"))
    for name in ("ib_again", "regular_in_ib", "ib_in_regular"):
        assert "resumed from step 4" in check_job(name, f[name], launch)
    losses = {n: step_losses(folder) for n, folder in f.items()}
    after = range(5, 9)
    assert [losses["ib_again"][s] for s in after] == [losses["ib"][s] for s in after]
    # the other mode from the same step-4 state: the same arithmetic, so the source run's losses
    for name, source in (("regular_in_ib", "regular"), ("ib_in_regular", "ib")):
        got, want = [losses[name][s] for s in after], [losses[source][s] for s in after]
        assert max(abs(g - w) / w for g, w in zip(got, want)) <= RTOL, (name, got, want)
