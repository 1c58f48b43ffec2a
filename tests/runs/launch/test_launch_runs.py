"""The launcher and the run lock end to end: a rank's error or crash is printed once with its rank,
a second run on a live dump folder is refused, and killing the launcher stops its ranks.

The first two launch ``tests/support/failing_worker.py`` (ranks that do not import torch) through
``python -m torchtitan.launch``; the others run the trainer through run_llama_train.sh: the run lock, which config
a launch trains (a TOML argument over CONFIG_FILE, two TOMLs refused, a config function's run at 2 ranks).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time

import pytest
import tomllib

from tests.support.held_marker_train import LAUNCH  # run_llama_train.sh's launch: NGPU=2, the user watches rank 0
from tests.support.runs import ROOT
from torchtitan.config import JobConfig


def _launch_failing(mode: str) -> tuple[int, str]:
    result = subprocess.run(
        [*LAUNCH, "-m", "tests.support.failing_worker", mode], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    return result.returncode, result.stdout + result.stderr


def test_a_user_error_on_rank1_is_one_line_with_its_rank():
    code, out = _launch_failing("user_error")
    lines = [line for line in out.splitlines() if line.startswith(("error", "crash"))]
    assert lines == ["error (rank 1): data file 'corpus.jsonl', line 44: 'text' is null; fix or remove that row"], out
    assert code == 2
    # rank 0's own failure after it ("Connection closed by peer") is a consequence: not shown
    assert "Traceback" not in out and "ChildFailedError" not in out and "Connection closed" not in out, out


def test_a_crash_on_rank1_shows_its_traceback_once():
    code, out = _launch_failing("crash")
    assert code == 1
    assert [line for line in out.splitlines() if line.startswith(("error", "crash"))] == [
        "crash (rank 1): RuntimeError: boom"
    ], out
    assert out.count("Traceback (most recent call last)") == 1 and 'raise RuntimeError("boom")' in out, out
    assert "ChildFailedError" not in out and "each rank's full output: " in out, out


# --------------------------------------------------------------------------- the real trainer


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _train(folder: str, ngpu: int, steps: int) -> tuple[list[str], dict[str, str]]:
    args = ["--training.steps", str(steps), "--training.seq_len", "64", "--training.batch_size", "2"]
    env = dict(os.environ, NGPU=str(ngpu), PREFLIGHT="0", CONFIG_FILE="./train_configs/debug_model.toml")
    return ["bash", "./run_llama_train.sh", *args, "--metrics.log_freq", "1", "--job.dump_folder", folder], env


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the ranks through /proc")
def test_a_second_run_is_refused_and_killing_the_launcher_stops_the_ranks(tmp_path):
    folder = str(tmp_path / "run")
    metrics = os.path.join(folder, "metrics.jsonl")
    cmd, env = _train(folder, ngpu=2, steps=100_000)
    with open(tmp_path / "first.out", "w") as out:
        first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not (os.path.isfile(metrics) and os.path.getsize(metrics)) and time.monotonic() < deadline:
            assert first.poll() is None, (tmp_path / "first.out").read_text()[-3000:]
            time.sleep(0.5)
        ranks = _children(first.pid)  # run_llama_train.sh exec'd the launcher: its children are the ranks
        assert len(ranks) == 2, ranks
        with open(os.path.join(folder, "run.lock")) as f:
            holder = json.load(f)
        assert holder["host"] == socket.gethostname() and holder["pid"] in ranks

        cmd2, env2 = _train(folder, ngpu=1, steps=1)
        second = subprocess.run(cmd2, cwd=ROOT, env=env2, capture_output=True, text=True, timeout=240)
        out2 = second.stdout + second.stderr
        assert second.returncode == 2, out2[-3000:]
        errors = [line for line in out2.splitlines() if line.startswith("error")]
        assert errors == [
            f"error (rank 0): job.dump_folder '{folder}' is in use by a run on host {socket.gethostname()} "
            f"(pid {holder['pid']}, started {holder['started']}); wait for it, stop it, or choose another "
            f"job.dump_folder. If that run is gone, delete {folder}/run.lock"
        ], out2[-3000:]
        records = open(metrics).read()
        assert records.startswith('{"step": 1'), "the refused run wrote into the first run's metrics"

        os.kill(first.pid, signal.SIGKILL)  # the launcher only: torchrun put the ranks in sessions of their own
        first.wait()
        deadline = time.monotonic() + 45  # 1 s to notice, then the step in flight, or 30 s at most
        while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(r) for r in ranks), "orphaned ranks still running"
        assert time.monotonic() < deadline
    finally:
        for pid in [first.pid, *ranks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    lock = os.path.join(folder, "run.lock")
    assert not os.path.exists(lock) or not _alive(json.load(open(lock))["pid"])  # released, or stale


# --------------------------------------------------------------------------- which config file a launch trains


def test_the_readme_sft_command_trains_the_sft_config_over_config_file(tmp_path):
    """README's `./run_llama_train.sh --job.config_file train_configs/sft_debug.toml`, with CONFIG_FILE also set:
    the argument wins (one line says so), in the pre-launch check and in the ranks alike. With an in-loop eval at
    its one step (where lm-eval is installed; issue 56, item 7): one line in the log, none of lm-eval's notes,
    hints or progress bars. Four steps logged every 2nd, validation at step 3: the step after it logs the tokens of
    its own window, not of the two since the last log (issue 56, item 2)."""
    folder = str(tmp_path / "sft")
    env = dict(os.environ, NGPU="1", CONFIG_FILE="./train_configs/debug_model.toml")
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    cmd = ["bash", "./run_llama_train.sh", "--job.config_file", "train_configs/sft_debug.toml"]
    cmd += ["--training.steps", "4", "--metrics.log_freq", "2", "--job.dump_folder", folder]
    cmd += ["--validation.enabled", "--validation.freq", "3", "--validation.steps", "1"]
    evaluates = importlib.util.find_spec("lm_eval") is not None
    if evaluates:
        cmd += ["--eval.enabled", "--eval.tasks", "arith_mc", "--eval.limit", "4"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    # the pre-launch check in the launcher's process (torchtitan.preflight_launch): one line, before any rank's output
    stdout = result.stdout.splitlines()
    oks = [i for i, line in enumerate(stdout) if line.startswith("ok: train_configs/sft_debug.toml, world_size 1, ")]
    assert len(oks) == 1 and not [line for line in stdout[: oks[0]] if "[rank0]" in line], out[-3000:]
    notes = [line for line in out.splitlines() if line.startswith("note: training with")]
    assert notes == [
        "note: training with --job.config_file train_configs/sft_debug.toml "
        "(it overrides CONFIG_FILE=./train_configs/debug_model.toml)"
    ], out[-3000:]
    # the start summary names the data by its kind and where the weights come from (issue 56, item 5)
    assert "data        chat: sft_arith\n" in out and "start       fresh: weights initialized from" in out, out[-3000:]
    if evaluates:
        lines = out.splitlines()
        first = next(i for i, line in enumerate(lines) if "outputs     " in line)
        after = lines[first + 1 : next(i for i, line in enumerate(lines) if " done: " in line)]
        evals = [line for line in after if "eval at step 4/4  arith_mc/acc " in line]
        assert len(evals) == 1, after
        assert not [line for line in after if not re.search(r"step \d/4 |epoch 0", line)], after
    records = [r for line in open(os.path.join(folder, "metrics.jsonl")) if "loss" in (r := json.loads(line))]
    assert [r["step"] for r in records] == [1, 2, 4], records  # the training steps' records
    # a step's window holds at most 4 samples x 128 tokens, its answers fewer; never two windows' worth
    for key in ("tokens_per_step", "trained_tokens_per_step"):
        per_step = [r[key] for r in records]
        assert all(0 < t <= 4 * 128 for t in per_step) and max(per_step) < 1.5 * min(per_step), (key, per_step)
    with open(os.path.join(folder, "config.toml")) as f:
        dumped = f.read()
    assert 'dataset = "sft_arith"' in dumped and 'dataset_format = "chat"' in dumped


def test_two_different_config_files_are_one_line_and_exit_2():
    cmd = ["bash", "./run_llama_train.sh", "--job.config_file", "train_configs/sft_debug.toml"]
    cmd += ["--job.config_file=train_configs/debug_model.toml"]
    result = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, NGPU="1"), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "error: --job.config_file given 2 different files: 'train_configs/sft_debug.toml', "
        "'train_configs/debug_model.toml'; pass one (run_llama_train.sh: --job.config_file FILE, or CONFIG_FILE=FILE)"
    ]
    assert result.stdout == ""


def test_a_config_function_trains_at_2_ranks_and_its_run_reproduces_without_it(tmp_path):
    """Issue 88 item 1: `MODULE=train_configs.recipes CONFIG=debug_model ./run_llama_train.sh` (upstream's launcher's
    variables; the --module/--config flags resolve to the same arguments, tests/unit/test_config_as_code.py) at 2
    ranks: the launcher's check names the function, --training.steps wins over its 30 steps, config.toml is what the
    TOML route writes for the same settings, and the run folder names the function while command.txt's last line
    trains config.toml, with no module."""
    folder = str(tmp_path / "fn")
    env = {k: v for k, v in os.environ.items() if k != "CONFIG_FILE"}
    env.update(NGPU="2", MODULE="train_configs.recipes", CONFIG="debug_model")
    flags = ["--training.steps", "2", "--training.seq_len", "32", "--training.batch_size", "1"]
    flags += ["--model.flavor", "debugmodel_tiny", "--metrics.log_freq", "1", "--job.dump_folder", folder]
    result = subprocess.run(
        ["bash", "./run_llama_train.sh", *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("ok: ")][0].startswith(
        "ok: debug_model() of train_configs.recipes, world_size 2, "
    ), out[-3000:]
    records = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    as_toml = JobConfig.parse_args(["--job.config_file", "train_configs/debug_model.toml", *flags])
    with open(os.path.join(folder, "config.toml"), "rb") as f:
        dumped = tomllib.load(f)
    expected = tomllib.loads(as_toml.to_toml())
    assert expected["job"].pop("config_file") == "train_configs/debug_model.toml"
    assert dumped == expected
    recipes = os.path.join(ROOT, "train_configs", "recipes.py")
    info = json.load(open(os.path.join(folder, "run_info.json")))["config_function"]
    assert (info["module"], info["function"], info["file"]) == ("train_configs.recipes", "debug_model", recipes)
    command = open(os.path.join(folder, "command.txt")).read().splitlines()
    assert command[1] == (
        f"# config built by debug_model() of train_configs.recipes ({recipes}); config.toml holds its values"
    )
    # the reproduce line: the run's config.toml through the script, no module; its config is the run's
    words = shlex.split(command[-1].partition(" && ")[2])
    assigned = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
    args = words[[i for i, w in enumerate(words) if w.endswith("run_llama_train.sh")][0] + 1 :]
    assert assigned["CONFIG_FILE"] == os.path.join(folder, "config.toml") and "--module" not in args, command[-1]
    again = tomllib.loads(JobConfig.parse_args(["--job.config_file", assigned["CONFIG_FILE"], *args]).to_toml())
    assert again["job"].pop("config_file") == assigned["CONFIG_FILE"]
    assert again["job"].pop("dump_folder") == folder + "-reproduced" and expected["job"].pop("dump_folder") == folder
    assert again == expected
