"""docs/rl.md's first step, ``python -m bench.sft_arith``, as a user runs it (subprocesses, the command as typed):
its progress is on screen as it trains and the first line names the log; Ctrl-C stops it at a checkpoint and the
same command resumes from there (the folder is not emptied; stopped again once it has trained on, so neither run
pays for the scoring); a command of other settings is refused in one line rather than emptying that checkpoint (in
process)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.support.runs import ROOT

pytestmark = [pytest.mark.integration]

STEPS = 40
STEP_LINE = re.compile(rf"INFO step +\d+/{STEPS} ")


def _ctrl_c_after_a_step(folder: str) -> tuple[int, str]:
    """The bench started as typed, Ctrl-C (SIGINT to its process group, as a terminal sends it) once its trainer has
    logged a step line on screen; (exit code, what it printed on stderr)."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench.sft_arith", "--steps", str(STEPS), "--dump_folder", folder],
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    seen = []
    deadline = time.monotonic() + 300
    for line in bench.stderr:  # the trainer's lines arrive as it trains, not at the end
        seen.append(line)
        if STEP_LINE.search(line) or time.monotonic() > deadline:
            break
    assert STEP_LINE.search(seen[-1]), "".join(seen)[-3000:]
    os.killpg(bench.pid, signal.SIGINT)
    rest = bench.stderr.read()  # to its end (communicate would skip what the line reader holds)
    bench.wait(timeout=300)
    return bench.returncode, "".join(seen) + rest


def test_sft_bench_shows_progress_stops_on_ctrl_c_and_the_same_command_resumes(tmp_path):
    folder = str(tmp_path / "sft")
    code, out = _ctrl_c_after_a_step(folder)
    assert out.index(f"(also in {folder}/bench.log)") < STEP_LINE.search(out).start(), out[:3000]  # named first
    assert code == 3, out[-3000:]  # the trainer's stop, its checkpoint saved
    assert "bench.sft_arith: the trainer stopped at a checkpoint" in out and "run the same command to resume" in out
    (stopped,) = _checkpoints(folder)  # the step in flight, saved
    assert 1 <= stopped < STEPS, out[-3000:]
    weights = os.path.join(folder, "hf_in", "model.safetensors")
    built = os.stat(weights).st_mtime_ns

    code, out = _ctrl_c_after_a_step(folder)  # the same command: resumes, then stopped again
    assert code == 3, out[-3000:]
    assert f"resuming after step {stopped}" in out and f"resumed from step {stopped}" in out, out[-3000:]
    assert _checkpoints(folder)[-1] > stopped  # trained on from there
    assert os.stat(weights).st_mtime_ns == built  # the folder was kept, its HF start not rebuilt
    with open(os.path.join(folder, "bench.log")) as f:
        assert f.read().count("start       ") == 2  # both runs' trainer output, the first kept


def _checkpoints(folder: str) -> list[int]:
    root = os.path.join(folder, "run", "checkpoint")
    return sorted(int(d[5:]) for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, ".complete")))


def test_sft_bench_refuses_a_folder_holding_a_checkpoint_of_other_flags(tmp_path, capsys):
    """Another command's folder is not emptied under it: one line naming the flag that differs, exit 2 (in process:
    the decision is made before anything is built)."""
    from bench.sft_arith import FLAGS_FILE, prepare_folder

    base = tmp_path / "sft"
    flags = ["--training.steps", "40", "--training.seed", "0"]
    assert prepare_folder(base, flags) is None  # a new folder: emptied, its flags recorded
    assert json.loads((base / FLAGS_FILE).read_text()) == flags
    step = base / "run" / "checkpoint" / "step-40"
    step.mkdir(parents=True)
    (step / ".complete").write_text(json.dumps({"step": 40, "kind": "full"}))
    assert prepare_folder(base, flags) == 40  # the same flags: resumed, kept
    with pytest.raises(SystemExit) as exit_:
        prepare_folder(base, ["--training.steps", "41", "--training.seed", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "holds a checkpoint (step-40) of another bench run (--training.steps: 40 -> 41)" in err
    )
    assert step.is_dir()  # not emptied
