"""Checkpoints in an object store through the trainer: FSDP2 on 2 ranks saving to s3:// on a real S3-compatible
server (moto's, on localhost: tests/support/s3_server.py), worker-pool jobs that share one bucket prefix:

* A, FSDP2 (2 ranks), async saves every 2 steps, keep_latest_k 1; rank 0 crashes just before step-6's marker
  (``before_marker``, where tests/runs/checkpoint/test_checkpoint_runs.py SIGKILLs: the objects in the bucket are the same) -> step-2
  deleted by retention once step-4 is complete, step-4 complete with every object's CRC32, step-6's objects there
  but no marker. Its losses are the uninterrupted run's (step 6 is logged before its save).
* B, FSDP2 (2 ranks) in another dump folder (another machine, say) on the same URL -> ignores the unmarked step-6,
  resumes from step-4: steps 5-6 bit-exact with A; replaces step-6 (complete now; keep_latest_k 2 keeps step-4).
* C, one process on the same URL with load_step 4 -> step-6 is moved aside (copy + delete), steps 5-6 within RTOL
  of A (another layout), and its last checkpoint exported to a local Hugging Face folder (last_save_in_hf).

One-process behaviour (CRCs, foreign pickles, the pre-launch check's refusals) is tests/unit/test_remote_storage.py.
"""

from __future__ import annotations

import functools
import json
import os

import pytest

from tests.support.matrix import RTOL
from tests.support.pool import JobFailed, run_in_pool
from tests.support.runs import STEPS, read_metrics, trainer_argv
from tests.support.s3_server import BUCKET, s3_server, train_job_with_env

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2)]

CRASH = "crashed before step-6's marker (the test's)"


def crash_before_marker(step: int, at: int) -> None:
    """``CheckpointManager``'s ``before_marker`` (rank 0): fail where a crash would leave data and no marker."""
    if step == at:
        raise RuntimeError(CRASH)


def _losses(folder: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(folder) if "loss" in r}


def _job(ngpu: int, env: dict, folder: str, args: list[str], builders=None) -> list:
    argv = trainer_argv(["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", *args], folder)
    return run_in_pool(train_job_with_env, ngpu, env, argv, builders, name=f"train {os.path.basename(folder)}")


def _log(folder: str) -> str:
    with open(os.path.join(folder, "rank0.log")) as f:
        return f.read()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Runs A, B and C (module docstring) and what the bucket held after each."""
    from torchtitan.checkpointing.files import storage
    from torchtitan.checkpointing.files.folders import list_checkpoints
    from torchtitan.engine.builders import Builders, build_checkpointer

    base = tmp_path_factory.mktemp("remote")
    out: dict = {}
    with s3_server() as s3:
        url = f"s3://{BUCKET}/run"
        ck = ["--checkpoint.folder", url, "--checkpoint.keep_latest_k"]
        crash_at_last = functools.partial(crash_before_marker, at=STEPS)
        crash = Builders(checkpointer=functools.partial(build_checkpointer, before_marker=crash_at_last))
        a, b, c = (str(base / name) for name in "abc")
        async_saves = ["--checkpoint.async_mode", "async"]
        out["a"] = _job(2, s3.environ, a, [*ck, "1", "--training.batch_size", "4", *async_saves], crash)
        with s3.env():
            out["after_a"] = list_checkpoints(url)
            fs, key = storage.filesystem(url)
            out["step6_objects"] = sorted(os.path.basename(p) for p in fs.find(f"{key}/step-{STEPS}"))
        out["b"] = _job(2, s3.environ, b, [*ck, "2", "--training.batch_size", "4"])
        with s3.env():
            out["after_b"] = list_checkpoints(url)
        rollback = ["--checkpoint.load_step", "4", "--checkpoint.last_save_in_hf"]
        out["c"] = _job(1, s3.environ, c, [*ck, "0", "--training.batch_size", "8", *rollback])
        with s3.env():
            out["after_c"] = list_checkpoints(url)
            out["set_aside"] = sorted(p[len(key) + 1 :] for p in fs.find(f"{key}/set-aside"))
    for name, folder in zip("abc", (a, b, c)):
        out[f"{name}_losses"], out[f"{name}_log"], out[f"{name}_folder"] = _losses(folder), _log(folder), folder
    return out


def test_a_crash_before_the_marker_leaves_no_loadable_checkpoint_and_retention_deletes_in_the_bucket(runs):
    rank0, rank1 = runs["a"]
    assert isinstance(rank0, JobFailed) and CRASH in rank0.error and rank1 is None, runs["a"]
    assert "writing in the background" in runs["a_log"] or "written in the background" in runs["a_log"]
    assert sorted(runs["a_losses"]) == list(range(1, STEPS + 1))
    # step-2 purged once step-4 was complete (keep_latest_k 1); step-6 written but never marked
    assert [(c.step, c.complete) for c in runs["after_a"]] == [(4, True), (STEPS, False)]
    files = runs["after_a"][0].marker["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert all(crc != -1 for _, crc in files.values())  # each rank's CRC32 from its sidecar, as on disk
    assert ".metadata" in runs["step6_objects"] and ".complete" not in runs["step6_objects"]


def test_another_machine_resumes_from_the_bucket_bit_exact(runs):
    assert runs["b"] == [None, None], runs["b"]
    log = runs["b_log"]
    assert "ignoring incomplete checkpoint" in log and "resumed from step 4" in log
    assert sorted(runs["b_losses"]) == [5, STEPS]  # a dump folder of its own: only the steps it trained
    assert [runs["b_losses"][s] for s in (5, STEPS)] == [runs["a_losses"][s] for s in (5, STEPS)]
    assert [(c.step, c.complete) for c in runs["after_b"]] == [(4, True), (STEPS, True)]  # step-6 replaced


def test_a_rollback_on_one_process_sets_aside_in_the_bucket_and_exports_locally(runs):
    assert runs["c"] == [None], runs["c"]
    assert "resumed from step 4" in runs["c_log"]
    for s in (5, STEPS):
        got, want = runs["c_losses"][s], runs["a_losses"][s]
        assert abs(got - want) <= RTOL * abs(want), f"step {s}: {got} vs uninterrupted {want}"
    assert [(c.step, c.complete) for c in runs["after_c"]] == [(4, True), (STEPS, True)]
    moved = [p for p in runs["set_aside"] if p.endswith(f"/step-{STEPS}/.complete")]
    assert len(moved) == 1 and moved[0].startswith("set-aside/abandoned-after-resume-from-step-4-"), runs["set_aside"]
    with open(os.path.join(runs["c_folder"], "hf", f"step-{STEPS}", "config.json")) as f:
        assert json.load(f)["model_type"] == "llama"
