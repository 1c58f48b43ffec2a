"""The step replay (training.replay_every_n_steps, features/replay/replay.py) through the trainer at 2 ranks.

Clean runs with replay on (pool jobs) equal the matrix's rows without it bit for bit, losses and grad norms (and
the MoE row's expert load, whose counts the replay must not double): FSDP2 with gradient accumulation 2 (the
replay re-runs both micro-batches) and the MoE FSDP2 row. A flipped bit in rank 1's gradient on its second pass
(tests/support/replay_flip.py, through the product's ``Builders.overrides['step_pass']`` seam): with 'warn' the run goes on and
logs the line; with 'stop', launched like run_llama_train.sh, the launcher prints one line naming the rank, its
host, the step and the tensor, exits 6, and the checkpoints are those before the step.
"""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from tests.support.held_marker_train import LAUNCH
from tests.support.matrix import MOE_ROWS, ROWS, MatrixLaunches, job_argv
from tests.support.pool import run_in_pool, run_train_job, train_job
from tests.support.replay_flip import TENSOR, builders
from tests.support.runs import COMMON, ROOT, complete_steps, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.pool(2)]

REPLAY = ["--training.replay_every_n_steps", "2"]


def _records(folder: str) -> list[dict]:
    return [r for r in read_metrics(folder) if "loss" in r]


@pytest.mark.parametrize("name", ["fsdp2_grad_accum2", "moe_fsdp2"])
def test_a_clean_run_with_replay_equals_the_run_without_bit_for_bit(name, matrix: MatrixLaunches, tmp_path):
    row = next(r for r in ROWS + MOE_ROWS if r.name == name)
    matrix.run(row)
    folder = str(tmp_path / name)
    argv = job_argv(row, folder)
    status = run_train_job(row.ngpu, [*argv[:-2], *REPLAY, *argv[-2:]])
    assert status["ok"], status["error"]
    got, want = _records(folder), _records(matrix.folder(row))
    assert len(got) == len(want) == 6
    for key in ("loss", "grad_norm", *(("expert_load",) if name.startswith("moe") else ())):
        assert [r[key] for r in got] == [r[key] for r in want], key
    with open(os.path.join(folder, "rank0.log")) as f:
        replayed = [line for line in f if "step replay: step" in line]
    assert [line.split("step replay: step ")[1].split()[0] for line in replayed] == ["2", "4", "6"], replayed


def test_warn_logs_the_mismatch_and_goes_on(tmp_path):
    folder = str(tmp_path / "warn")
    args = [*REPLAY, "--training.on_replay_mismatch", "warn", "--training.batch_size", "4"]
    argv = ["--job.config_file", "./train_configs/debug_model.toml", *COMMON, *args, "--job.dump_folder", folder]
    results = run_in_pool(train_job, 2, argv, builders(rank=1, step=2))  # a job with the fault injected
    assert results == [None, None], [r.error for r in results if r is not None]
    assert [r["step"] for r in _records(folder)] == list(range(1, 7))
    with open(os.path.join(folder, "rank0.log")) as f:
        log = f.read()
    lines = [line for line in log.splitlines() if "computed other numbers" in line]
    assert len(lines) == 1, lines
    for step in (4, 6):  # replayed too, and matched
        assert f"step replay: step {step} replayed on every rank, the same loss and gradients" in log
    assert "step 2 computed other numbers" in lines[0] and f"rank 1 (host {socket.gethostname()})" in lines[0]
    assert f"gradient of {TENSOR} (checksum" in lines[0] and "'warn'" in lines[0]


def test_stop_is_one_line_with_exit_code_6_and_keeps_the_last_checkpoint(tmp_path):
    folder = str(tmp_path / "stop")
    args = ["--training.replay_every_n_steps", "3", "--training.batch_size", "4", "--training.steps", "4"]
    args += ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "1"]
    argv = ["1", "3", "--job.config_file", "./train_configs/debug_model.toml", *COMMON, *args]
    run = subprocess.run(
        [*LAUNCH, "-m", "tests.support.replay_flip", *argv, "--job.dump_folder", folder],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 6, out[-3000:]
    lines = [line for line in out.splitlines() if "step replay:" in line]
    assert len(lines) == 1 and lines[0].startswith("error (ranks 0,1): step replay: step 3 "), out[-3000:]
    assert f"rank 1 (host {socket.gethostname()}): gradient of {TENSOR}" in lines[0]
    assert "Traceback" not in out, out[-3000:]
    assert complete_steps(folder) == [1, 2]  # no checkpoint of the step that differed
    assert [r["step"] for r in _records(folder)] == [1, 2]
