"""Runs that used to lose work (issue: "a run that loses nothing"), each through the real trainer at 2 ranks.

Runs are shared to keep CI short: a pool job (tests/support/pool.py) saves the checkpoints the others start
from, a pool job of its own has its ranks killed mid-save, a real run (run_llama_train.sh) gets Ctrl-C twice
mid-way, and a final series of pool jobs runs every check that resumes (a model change refused, a changed optimizer config, a plain resume after a
rollback, the resume after Ctrl-C and its uninterrupted reference).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from tests.support.held_marker_train import kill_mid_save
from tests.support.runs import (
    COMMON,
    ROOT,
    check_job,
    complete_steps,
    launch_jobs,
    read_metrics,
    run_train,
    step_losses,
)

pytestmark = [pytest.mark.integration, pytest.mark.pool(2)]

CKPT = ["--checkpoint.enable_checkpoint"]
# A warmup longer than any run here: the LR at a step (and so the losses) then does not depend on
# training.steps, so the Ctrl-C run (1000 steps, stopped early) compares with the 6-step "saved" run.
WARMUP = 1000
BATCH = ["--training.batch_size", "4", "--training.warmup_steps", str(WARMUP)]


def job(folder: str, *args: str, expect_error: str | None = None) -> dict:
    spec = {"argv": [*COMMON, *CKPT, *BATCH, *args, "--job.dump_folder", folder]}
    if expect_error is not None:
        spec["expect_error"] = expect_error
    return spec


def popen_train(folder: str, args: list[str]) -> subprocess.Popen:
    """run_llama_train.sh in the background, as a user starts it (the pre-launch check in the launcher's process);
    its output goes to ``<folder>.out`` (read with ``output``)."""
    overrides = [*COMMON, *CKPT, *BATCH, *args, "--job.dump_folder", folder]
    environ = dict(os.environ, NGPU="2", LOG_RANK="0", CONFIG_FILE="./train_configs/debug_model.toml")
    with open(folder + ".out", "w") as out:
        return subprocess.Popen(
            ["bash", "./run_llama_train.sh", *overrides],
            cwd=ROOT,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def output(folder: str) -> str:
    with open(folder + ".out") as f:
        return f.read()


def wait_for(
    predicate, proc: subprocess.Popen, folder: str, what: str, timeout: float = 300, poll_s: float = 0.1
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"never saw {what}; run output:\n{output(folder)[-3000:]}")
        time.sleep(poll_s)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("reliability")
    d = {name: str(base / name) for name in ("saved", "norm", "config", "rollback", "ctrl_c")}
    first = launch_jobs(2, [job(d["saved"], "--checkpoint.interval", "2")], str(base / "first.json"))
    check_job("saved", d["saved"], first)
    assert complete_steps(d["saved"]) == [2, 4, 6]
    for name in ("norm", "config", "rollback"):
        shutil.copytree(os.path.join(d["saved"], "checkpoint"), os.path.join(d[name], "checkpoint"))
    out = {"dirs": d}

    # Rollback to step 2 with keep_latest_k 1, its ranks SIGKILLed (a crash) while step-4 is being saved again: a
    # job in a pool of its own (what the crash leaves on disk is the point, not what a launcher prints).
    rollback = ["--checkpoint.load_step", "2", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1"]
    root = os.path.join(d["rollback"], "checkpoint")
    step4 = os.path.join(root, "step-4")

    def resaving_step4() -> bool:  # the copied step-4 is complete; the new one's data is written, no marker
        new_step3 = os.path.isfile(os.path.join(root, "step-3", ".complete"))
        return (
            new_step3 and os.path.isfile(os.path.join(step4, ".metadata")) and not os.path.exists(step4 + "/.complete")
        )

    kill_mid_save(4, [*COMMON, *CKPT, *BATCH, *rollback, "--job.dump_folder", d["rollback"]], resaving_step4)
    out["after_kill"] = complete_steps(d["rollback"])
    out["set_aside"] = sorted(
        name for _, dirs, _ in os.walk(os.path.join(d["rollback"], "checkpoint", "set-aside")) for name in dirs
    )

    # Ctrl-C twice, as a terminal sends it (SIGINT to the launcher's process group), once step 2 is logged: the step
    # in flight finishes and is saved. The second SIGINT at least 0.3 s after the first, once the launcher says it
    # passed the first on: the ranks have stopped and it is reporting (where a second Ctrl-C printed torchelastic's
    # SignalException traceback, issue 84).
    proc = popen_train(d["ctrl_c"], ["--training.steps", "1000", "--checkpoint.interval", "500"])
    metrics = os.path.join(d["ctrl_c"], "metrics.jsonl")
    wait_for(lambda: os.path.isfile(metrics) and len(open(metrics).readlines()) >= 2, proc, d["ctrl_c"], "step 2")
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.3)
    wait_for(
        lambda: "launcher: received SIGINT" in output(d["ctrl_c"]), proc, d["ctrl_c"], "the launcher's line", 60, 0.01
    )
    os.killpg(proc.pid, signal.SIGINT)
    out["ctrl_c_returncode"] = proc.wait(timeout=120)
    out["ctrl_c_output"] = output(d["ctrl_c"])
    out["ctrl_c_steps"] = complete_steps(d["ctrl_c"])
    out["ctrl_c_losses"] = step_losses(d["ctrl_c"])

    last = [
        job(d["norm"], "--model.norm_type", "layernorm", expect_error="holds another model"),
        job(
            d["config"],
            "--checkpoint.load_step",
            "4",
            "--optimizer.lr",
            "3e-2",
            "--optimizer.weight_decay",
            "0.3",
            "--optimizer.beta2",
            "0.9",
        ),
        job(d["rollback"], "--checkpoint.keep_latest_k", "1"),
        job(d["ctrl_c"]),  # resumes from the step it stopped at, to step 6
    ]
    out["last"] = launch_jobs(2, last, str(base / "last.json"))
    return out


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    from torchtitan.checkpointing.common import load_model_weights

    folder = str(tmp_path)
    args = [*CKPT, "--training.batch_size", "4", "--optimizer.lr", "1e6", "--training.warmup_steps", "1"]
    result = run_train(2, folder, [*args, "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1"])
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert "is not finite" in out and "Traceback" not in out, out[-3000:]
    found = re.search(r"error \(ranks? [\d,]+\): step (\d+): ", out)
    assert found, out[-3000:]  # one line from the launcher, naming the ranks and the step
    bad_step = int(found.group(1))
    steps = complete_steps(folder)
    assert steps == [bad_step - 1], steps  # the good one before it, never a checkpoint of the bad step
    weights, marker = load_model_weights(os.path.join(folder, "checkpoint", f"step-{bad_step - 1}"))
    assert marker["step"] == bad_step - 1 and all(t.isfinite().all() for t in weights.values())
    assert [r["step"] for r in read_metrics(folder) if "loss" in r][-1] == bad_step - 1


def test_rollback_keeps_a_loadable_checkpoint_through_a_kill(runs):
    d = runs["dirs"]
    # step-4 and step-6 of the abandoned branch were set aside (not deleted) when step 2 was loaded;
    # step-3 is the new branch's, complete; the re-save of step 4 was killed before its marker.
    assert runs["after_kill"] == [3], runs["after_kill"]
    assert {"step-4", "step-6"} <= set(runs["set_aside"]), runs["set_aside"]
    log = check_job("rollback resume", d["rollback"], runs["last"])
    assert "resumed from step 3" in log, log[-2000:]  # not the abandoned step-4 or step-6
    assert complete_steps(d["rollback"]) == [6]


def test_model_change_on_resume_is_refused(runs):
    d = runs["dirs"]
    check_job("norm_type change", d["norm"], runs["last"])
    with open(os.path.join(d["norm"], "job_status.json")) as f:
        error = json.load(f)["error"]
    assert "norm_type: checkpoint 'rmsnorm', config 'layernorm'" in error, error


def test_optimizer_config_changed_on_resume_takes_effect(runs):
    d = runs["dirs"]
    log = check_job("config change", d["config"], runs["last"])
    for key in ("optimizer.lr", "optimizer.weight_decay", "optimizer.betas"):
        assert key in log, log[-2000:]
    lr = {r["step"]: r["lr"] for r in read_metrics(d["config"]) if "lr" in r}
    # the lr logged at step s is the one set for step s + 1, (s + 1) / (WARMUP + 1) of the new peak 3e-2
    # (the checkpoint's run had COMMON's 1e-2)
    for s in (5, 6):
        assert lr[s] == pytest.approx(3e-2 * (s + 1) / (WARMUP + 1), rel=1e-9), lr


def test_ctrl_c_twice_saves_the_step_in_flight_quietly_and_resumes_bit_exact(runs):
    d = runs["dirs"]
    out, steps = runs["ctrl_c_output"], runs["ctrl_c_steps"]
    assert len(steps) == 1 and steps[0] >= 2, (steps, out[-3000:])
    stopped = steps[0]
    assert stopped < 6, f"the run stopped at step {stopped}, too late to compare with the 6-step reference"
    assert f"stopped (ranks 0,1): stopped by a signal after step {stopped}: checkpoint step-{stopped} saved" in out
    assert runs["ctrl_c_returncode"] == 3, out[-3000:]  # EXIT_STOPPED, not killed by the second SIGINT
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]  # the second Ctrl-C is quiet
    assert max(runs["ctrl_c_losses"]) == stopped
    log = check_job("ctrl_c resume", d["ctrl_c"], runs["last"])
    assert f"resumed from step {stopped}" in log
    got, want = step_losses(d["ctrl_c"]), step_losses(d["saved"])
    assert sorted(got) == list(range(1, 7))
    assert got == want  # bit-exact: the interrupted-and-resumed run equals the uninterrupted one
