"""What a user sees and keeps: validation at the configured frequency, the same validation loss under
every layout, a run reproducible from its dump folder, and plain (escape-free) output when redirected."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration_tests import ROOT, read_metrics, run_train

pytestmark = pytest.mark.integration

STEPS, VAL_FREQ = 4, 2
VALIDATION = ["--validation.enabled", "--validation.freq", str(VAL_FREQ), "--validation.steps", "2",
              "--training.steps", str(STEPS)]
RTOL = 1e-5  # fp32, as in the loss-parity matrix


def _validation(folder: str) -> dict[int, float]:
    return {r["step"]: r["validation_loss"] for r in read_metrics(folder) if "validation_loss" in r}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess]:
    folder = str(tmp_path_factory.mktemp("single"))
    result = run_train(1, folder, ["--training.batch_size", "8", *VALIDATION])
    assert result.returncode == 0, result.stderr[-3000:]
    return folder, result


def test_validation_logged_at_its_frequency_with_perplexity(single):
    folder, _ = single
    records = [r for r in read_metrics(folder) if "validation_loss" in r]
    assert [r["step"] for r in records] == list(range(VAL_FREQ, STEPS + 1, VAL_FREQ))
    for r in records:
        assert r["validation_perplexity"] == pytest.approx(2.718281828459045 ** r["validation_loss"], rel=1e-9)


@pytest.mark.parametrize(
    "ngpu, batch, extra",
    [
        (2, 4, []),
        (2, 8, ["--training.tensor_parallel_degree", "2"]),
        (2, 8, ["--experimental.pipeline_parallel_degree", "2", "--experimental.pipeline_parallel_microbatches", "4"]),
    ],
    ids=["fsdp2", "tp2", "pp2"],
)
def test_validation_loss_is_layout_invariant(single, ngpu, batch, extra, tmp_path):
    result = run_train(ngpu, str(tmp_path), ["--training.batch_size", str(batch), *VALIDATION, *extra])
    assert result.returncode == 0, result.stderr[-3000:]
    want, got = _validation(single[0]), _validation(str(tmp_path))
    assert got.keys() == want.keys()
    for step in want:
        assert abs(got[step] - want[step]) <= RTOL * want[step], (step, got[step], want[step])


def test_output_has_no_escape_codes_when_redirected(single):
    _, result = single
    assert "step 1/4" in result.stderr and "validation at step 2/4" in result.stderr
    assert "\x1b[" not in result.stdout + result.stderr


def test_rerun_from_dump_folder_reproduces_losses(single, tmp_path):
    folder, _ = single
    for name in ("config.toml", "command.txt", "run_info.json"):
        assert os.path.isfile(os.path.join(folder, name)), name
    info = json.load(open(os.path.join(folder, "run_info.json")))
    assert info["world_size"] == 1 and info["torch"].startswith("2.13")
    rerun = str(tmp_path / "rerun")
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan.train", "--job.config_file", os.path.join(folder, "config.toml"),
         "--job.dump_folder", rerun],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    original = [r for r in read_metrics(folder)]
    again = [r for r in read_metrics(rerun)]
    for key in ("loss", "validation_loss"):
        assert [r[key] for r in again if key in r] == [r[key] for r in original if key in r]
