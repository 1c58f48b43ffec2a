"""Checkpoint runs through the trainer (worker-pool jobs; the killed save through the launcher): bit-exact resume, resharded resume, a killed save.

Runs are shared between checks to keep the file short (6 steps, seq 64, the matrix's settings):

* fsdp2: a seed checkpoint (seed 7) in the folder, async saves every 2 steps, keep_latest_k 2 ->
  step-0 kept, step-2 purged, step-4/6 kept; resume with load_step 4 must give steps 5-6 bit-exact.
* fsdp2 (seed 7, no seed checkpoint) SIGKILLed while step-4's marker is held back -> the restart
  ignores the incomplete step-4, resumes from step-2, and its steps 1-6 equal the seeded run's
  exactly (the seed checkpoint holds exactly seed 7's init).
* tp2, pp2 (1F1B), cp2 and moe_ep2: save at 3, resume at 3 under the same layout -> bit-exact;
  the tp2 step-3 checkpoint also resumes on 1 process, the 1F1B one under Interleaved1F1B (2 stages
  per rank, one optimizer over both), the cp2 one under FSDP2 (the data-parallel degree changes
  1 -> 2), the MoE EP2 one under FSDP2 without EP (experts resharded; the expert_bias buffer is
  model state) -> within RTOL.
* fsdp2 with Muon and the no-decay preset, saving with async_mode = "async_with_pinned_mem" (step 4 trains while
  step-3 is staged in the background): save at 3, resume bit-exact; the checkpoint resumed on 1 process within RTOL.
* fsdp4 save at 3 -> fsdp2 x tp2 resume -> within RTOL (slow: two 4-process runs).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from tests.support.held_marker_train import kill_job, popen_held_marker
from tests.support.matrix import RTOL, pp_schedule
from tests.support.runs import COMMON, ROOT, STEPS, check_job, complete_steps, launch_jobs, step_losses
from tests.support.runs import train as pooled_train

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2, 4)]

CKPT = ["--checkpoint.enable_checkpoint"]


def train(ngpu: int, folder: str, args: list[str]) -> str:
    """A checkpointing run in the worker pool (tests/support/pool.py); returns rank 0's log."""
    result = pooled_train(ngpu, folder, [*CKPT, *args])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def assert_close(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    for s in steps:
        assert abs(got[s] - want[s]) <= RTOL * abs(want[s]), f"step {s}: {got[s]} vs uninterrupted {want[s]}"


@pytest.fixture(scope="module")
def seeded_fsdp2(tmp_path_factory) -> tuple[str, dict[int, float], str]:
    """(folder, per-step losses, log) of the fsdp2 run that starts from a seed-7 seed checkpoint."""
    folder = str(tmp_path_factory.mktemp("fsdp2"))
    env = dict(os.environ, CONFIG_FILE="./train_configs/debug_model.toml")
    seed = subprocess.run(
        ["bash", "./scripts/create_seed_checkpoint.sh", *COMMON, "--training.seed", "7", "--job.dump_folder", folder],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert seed.returncode == 0, seed.stderr[-3000:]
    assert complete_steps(folder) == [0]
    log = train(
        2,
        folder,
        [
            "--training.batch_size",
            "4",
            "--checkpoint.interval",
            "2",
            "--checkpoint.keep_latest_k",
            "2",
            "--checkpoint.async_mode",
            "async",
        ],
    )
    return folder, step_losses(folder), log


def test_fsdp2_seed_async_purge_and_load_step(seeded_fsdp2):
    folder, full, log = seeded_fsdp2
    assert "loaded seed weights (model only) from step 0" in log
    assert "written in the background" in log  # async saves at 2 and 4; the final one is synchronous
    assert complete_steps(folder) == [0, 4, 6]  # keep_latest_k 2 purged step-2; the seed is kept
    shutil.copy(os.path.join(folder, "metrics.jsonl"), os.path.join(folder, "uninterrupted.jsonl"))
    log = train(2, folder, ["--training.batch_size", "4", "--checkpoint.interval", "2", "--checkpoint.load_step", "4"])
    assert "resumed from step 4" in log
    resumed = step_losses(folder)
    assert sorted(resumed) == list(range(1, STEPS + 1))  # metrics.jsonl: steps 1-4 kept, 5-6 appended
    assert [resumed[s] for s in (5, 6)] == [full[s] for s in (5, 6)]


def test_killed_save_resumes_from_previous_complete(seeded_fsdp2, tmp_path):
    _, seeded, _ = seeded_fsdp2
    folder = str(tmp_path)
    args = [*CKPT, "--training.batch_size", "4", "--training.seed", "7", "--checkpoint.interval", "2"]
    # step-4's marker held back 120 s (tests/support/held_marker_train.py)
    proc = popen_held_marker(4, 120, [*COMMON, *args, "--job.dump_folder", folder], stdout=subprocess.DEVNULL)
    step4 = os.path.join(folder, "checkpoint", "step-4")
    deadline = time.monotonic() + 300
    while not os.path.isfile(os.path.join(step4, ".metadata")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    kill_job(proc)  # data written, marker held back: a crash mid-save
    assert os.path.isfile(os.path.join(step4, ".metadata")) and not os.path.exists(os.path.join(step4, ".complete"))
    log = train(2, folder, args)
    assert "ignoring incomplete checkpoint" in log and "resumed from step 2" in log
    got = step_losses(folder)
    assert [got[s] for s in range(1, STEPS + 1)] == [seeded[s] for s in range(1, STEPS + 1)]
    assert complete_steps(folder) == [2, 4, 6]


# name -> (local batch, layout args) of the run that saves at step 3 and resumes from it (2 processes),
# and (processes, local batch, layout args) of the run that resumes the same checkpoint resharded:
# the TP2 checkpoint on one process; the 1F1B one (a stage per rank) under Interleaved1F1B (two
# stages per rank: one optimizer over both parts, the whole-model names merged); the CP2 one, whose
# ranks share one data-parallel rank, under FSDP2 (two data-parallel ranks); the MoE EP2 one
# (experts split over the ranks) under FSDP2 without EP (expert_bias included).
# Muon beside AdamW with the no-decay preset (issue 47): the momentum buffers, sharded like their parameters,
# and the five param groups go through DCP; the FSDP2 checkpoint resumes on one process (every buffer resharded).
# Its step-3 save stages in the background (async_with_pinned_mem): step 4's forward and backward run during the
# copy, its update waits for it, so the bit-exact resume shows the checkpoint holds step 3's weights and moments.
MUON = ["--optimizer.name", "Muon", "--optimizer.no_decay", "norm,bias,embedding"]
PINNED = ["--checkpoint.async_mode", "async_with_pinned_mem"]
SAME_LAYOUT = {
    "tp2": (8, ["--training.tensor_parallel_degree", "2"]),
    "pp2_1f1b": (8, ["--experimental.pipeline_parallel_degree", "2", *pp_schedule("1F1B")]),
    "cp2": (
        8,
        ["--experimental.context_parallel_degree", "2", "--experimental.context_parallel_rotate_method", "alltoall"],
    ),
    "moe_ep2": (4, ["--model.name", "llama3_moe", "--experimental.expert_parallel_degree", "2"]),
    "fsdp2_muon": (4, [*MUON, *PINNED]),
}
RESHARDED = {
    "tp2": (1, 8, []),
    "pp2_1f1b": (2, 8, ["--experimental.pipeline_parallel_degree", "2", *pp_schedule("Interleaved1F1B")]),
    "cp2": (2, 4, []),
    "moe_ep2": (2, 4, ["--model.name", "llama3_moe"]),
    "fsdp2_muon": (1, 8, MUON),
}


def _job(folder: str, local_batch: int, layout: list[str], *extra: str) -> list[str]:
    return [
        "--job.config_file",
        "./train_configs/debug_model.toml",
        *COMMON,
        *CKPT,
        "--training.batch_size",
        str(local_batch),
        "--checkpoint.interval",
        "3",
        *layout,
        *extra,
        "--job.dump_folder",
        folder,
    ]


@pytest.fixture(scope="module")
def resumes(tmp_path_factory) -> dict[str, dict]:
    """Per layout: the uninterrupted losses, the same-layout resume's and the resharded resume's.

    Jobs in the 2-rank worker pool (tests/support/pool.py), in this order: every layout's full run, then every
    same-layout resume and 2-process resharded resume together, then the 1-process one.
    """
    base = tmp_path_factory.mktemp("resume")
    folders = {name: str(base / name) for name in SAME_LAYOUT}
    full = launch_jobs(2, [_job(folders[n], b, lay) for n, (b, lay) in SAME_LAYOUT.items()], str(base / "full.json"))
    out = {}
    for name, folder in folders.items():
        log = check_job(f"{name} (uninterrupted)", folder, full)
        out[name] = {"full": step_losses(folder), "full_log": log}
        other = str(base / f"{name}_other")
        shutil.copytree(os.path.join(folder, "checkpoint", "step-3"), os.path.join(other, "checkpoint", "step-3"))
    jobs = [_job(folders[n], b, lay, "--checkpoint.load_step", "3") for n, (b, lay) in SAME_LAYOUT.items()]
    jobs += [_job(str(base / f"{n}_other"), b, lay) for n, (ngpu, b, lay) in RESHARDED.items() if ngpu == 2]
    resumed = launch_jobs(2, jobs, str(base / "resume.json"))
    for name, folder in folders.items():
        check_job(f"{name} (resumed)", folder, resumed)
        out[name]["resumed"] = step_losses(folder)
    for name, (ngpu, batch, layout) in RESHARDED.items():
        other = str(base / f"{name}_other")
        if ngpu == 1:
            log = train(1, other, ["--training.batch_size", str(batch), *layout])
        else:
            log = check_job(f"{name} (resharded)", other, resumed)
        out[name]["resharded"], out[name]["resharded_log"] = step_losses(other), log
    return out


@pytest.mark.parametrize("name", SAME_LAYOUT)
def test_resume_same_layout_is_bit_exact(name, resumes):
    full, resumed = resumes[name]["full"], resumes[name]["resumed"]
    assert [resumed[s] for s in range(4, STEPS + 1)] == [full[s] for s in range(4, STEPS + 1)]
    assert "resumed from step 3" in resumes[name]["resharded_log"]
    assert_close(resumes[name]["resharded"], full, range(4, STEPS + 1))


def test_background_staging_says_what_it_blocked(resumes):
    log = resumes["fsdp2_muon"]["full_log"]
    assert "here the staging buffers are plain host memory" in log  # once, at start, on CPU
    assert "checkpoint step-3: blocked the step" in log and "(staging), written in the background" in log


@pytest.mark.slow
def test_resume_fsdp4_checkpoint_as_fsdp2_tp2(tmp_path):
    folder = str(tmp_path)
    train(4, folder, ["--training.batch_size", "2", "--checkpoint.interval", "3"])
    full = step_losses(folder)
    other = str(tmp_path / "fsdp2_tp2")
    shutil.copytree(os.path.join(folder, "checkpoint", "step-3"), os.path.join(other, "checkpoint", "step-3"))
    log = train(4, other, ["--training.batch_size", "4", "--training.tensor_parallel_degree", "2"])
    assert "resumed from step 3" in log
    assert_close(step_losses(other), full, range(4, STEPS + 1))
    with open(os.path.join(other, "checkpoint", "step-6", ".complete")) as f:
        assert json.load(f)["world_size"] == 4
