"""What a user sees and keeps: validation at the configured frequency, a run reproducible from its dump
folder, plain (escape-free) output when redirected, a start summary that names the data and the start, and the
same validation loss under FSDP2 and TP2 as in one process."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.support.matrix import RTOL
from tests.support.pool import run_train_job
from tests.support.runs import STEPS, VAL_FREQ, VALIDATION, read_metrics, train

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2)]


def test_validation_logged_at_its_frequency_with_perplexity(reference_run):
    folder, _ = reference_run
    records = [r for r in read_metrics(folder) if "validation_loss" in r]
    assert [r["step"] for r in records] == list(range(VAL_FREQ, STEPS + 1, VAL_FREQ))
    for r in records:
        assert r["validation_perplexity"] == pytest.approx(math.exp(r["validation_loss"]), rel=1e-9)


def test_output_has_no_escape_codes_when_redirected(reference_run):
    _, result = reference_run
    assert f"step 1/{STEPS}" in result.stderr and f"validation at step {VAL_FREQ}/{STEPS}" in result.stderr
    assert "\x1b[" not in result.stdout + result.stderr


def test_start_summary_names_the_data_by_kind_and_a_fresh_start(reference_run):
    """Issue 56, item 5: the text corpus is named 'text', the weights' origin is the seed (no checkpoint, no
    initial weights); no part-of-the-model line for a full run."""
    _, result = reference_run
    assert "data        text: pydocs\n" in result.stderr
    assert "start       fresh: weights initialized from training.seed 42\n" in result.stderr
    assert "trains      " not in result.stderr


def test_rerun_from_dump_folder_reproduces_losses(reference_run, tmp_path):
    folder, _ = reference_run
    for name in ("config.toml", "command.txt", "run_info.json"):
        assert os.path.isfile(os.path.join(folder, name)), name
    info = json.load(open(os.path.join(folder, "run_info.json")))
    assert info["world_size"] == 1 and info["torch"] == torch.__version__
    rerun = str(tmp_path / "rerun")
    # what `python -m torchtitan.train --job.config_file <dump>/config.toml` runs, as a 1-rank pool job
    # (the command itself runs in tests/unit/test_plot_metrics.py)
    status = run_train_job(1, ["--job.config_file", os.path.join(folder, "config.toml"), "--job.dump_folder", rerun])
    assert status["ok"], status["error"]
    original, again = read_metrics(folder), read_metrics(rerun)
    for key in ("loss", "validation_loss"):
        assert [r[key] for r in again if key in r] == [r[key] for r in original if key in r]


@pytest.mark.parametrize(
    "ngpu, batch, extra",
    [(2, 4, []), (2, 8, ["--training.tensor_parallel_degree", "2"])],
    ids=["fsdp2", "tp2"],
)
def test_validation_loss_is_layout_invariant(reference_run, ngpu, batch, extra, tmp_path):
    result = train(ngpu, str(tmp_path), ["--training.batch_size", str(batch), *VALIDATION, *extra])
    assert result.returncode == 0, result.stderr[-3000:]
    want = [r["validation_loss"] for r in read_metrics(reference_run[0]) if "validation_loss" in r]
    got = [r["validation_loss"] for r in read_metrics(str(tmp_path)) if "validation_loss" in r]
    assert len(got) == len(want) == STEPS // VAL_FREQ
    for g, w in zip(got, want):
        assert abs(g - w) <= RTOL * w, (got, want)
