"""One run per dump folder, and a reproduce line that reproduces (issue 34), through the trainer.

* A plain run, then a checkpointing run in the same folder: the first is moved whole into
  ``earlier_runs/``, the second's records hold only its own steps; a third run resumes the second's
  checkpoint and appends (its ``done:`` line counts this run's steps). 1-rank pool jobs, tiny flavor.
* command.txt's reproduce line of a 2-rank run, pasted into a shell (the launcher: a process of its
  own), gives the same per-step losses, with 2 processes.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.support.pool import run_train_job
from tests.support.runs import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2)]

TINY = [
    *("--job.config_file", "./train_configs/debug_model.toml", "--model.flavor", "debugmodel_tiny"),
    *("--training.seq_len", "32", "--training.warmup_steps", "1", "--metrics.log_freq", "1"),
    *("--training.mixed_precision_param", "float32", "--training.seed", "3"),
]


def _run(folder, *args: str, world_size: int = 1) -> str:
    status = run_train_job(world_size, [*TINY, *args, "--job.dump_folder", str(folder)])
    assert status["ok"], status["error"]
    with open(os.path.join(folder, "rank0.log")) as f:
        return f.read()


def _steps(folder) -> list[int]:
    return [r["step"] for r in read_metrics(str(folder)) if "loss" in r]


def test_second_run_is_set_aside_and_a_resume_appends(tmp_path):
    folder = tmp_path / "run"
    _run(folder, "--training.steps", "2", "--training.batch_size", "2", "--optimizer.lr", "1e-3")
    first = read_metrics(str(folder))
    ckpt = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--training.batch_size", "4"]
    log = _run(folder, *ckpt, "--training.steps", "2")
    (aside,) = os.listdir(folder / "earlier_runs")
    kept = folder / "earlier_runs" / aside
    assert sorted(os.listdir(kept)) == ["command.txt", "config.toml", "metrics.jsonl", "run_info.json"]
    assert read_metrics(str(kept)) == first  # nothing lost
    assert "lr = 0.001" in (kept / "config.toml").read_text() and "batch_size = 2" in (kept / "config.toml").read_text()
    assert f"moved its metrics.jsonl, config.toml, command.txt, run_info.json into {kept}" in log
    assert _steps(folder) == [1, 2] and "batch_size = 4" in (folder / "config.toml").read_text()  # nothing mixed
    assert (folder / "command.txt").read_text().count("# started by ") == 1
    second = read_metrics(str(folder))

    log = _run(folder, *ckpt, "--training.steps", "4")  # resumes from step-2: appends
    assert os.listdir(folder / "earlier_runs") == [aside]
    assert _steps(folder) == [1, 2, 3, 4] and read_metrics(str(folder))[:2] == second
    commands = (folder / "command.txt").read_text()
    assert commands.count("# started by ") == 2 and "# resumed from checkpoint step-2 at " in commands
    assert json.loads((folder / "run_info.json").read_text())["resumed_from_step"] == 2
    assert "done: 4 steps (2 this run, resumed after step 2) in " in log


def test_pasted_reproduce_line_gives_the_same_losses(tmp_path):
    folder = tmp_path / "run"
    _run(folder, "--training.steps", "3", "--training.batch_size", "4", world_size=2)
    lines = (folder / "command.txt").read_text().splitlines()
    assert lines[-2] == "# reproduce (2 processes; into run-reproduced/):"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    done = subprocess.run(["bash", "-c", lines[-1]], cwd="/", env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    again = f"{folder}-reproduced"
    assert json.loads(open(os.path.join(again, "run_info.json")).read())["world_size"] == 2
    want, got = read_metrics(str(folder)), read_metrics(again)
    assert [(r["step"], r["loss"]) for r in got] == [(r["step"], r["loss"]) for r in want]
