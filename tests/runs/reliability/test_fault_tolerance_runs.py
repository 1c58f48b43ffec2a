"""Fault tolerance through the trainer (docs/fault_tolerance.md): torchft replica groups on CPU/gloo, a lighthouse
on loopback. Skipped where torchft (the ``ft`` extra) is not installed.

* Parity: 2 groups x 1 rank and 2 groups x 2 ranks (FSDP inside) train, step for step, as the matrix's DDP2 and
  HSDP 2x2 rows (replicate 2): losses within the matrix's 1e-5, grad norms within its 3e-4; the shared
  checkpoint is written by group 0 alone, and both groups resume from it after a full stop, bit for bit.
* scripts/ft_local.sh, as its doc runs it: a group SIGKILLed (its whole process group) and restarted with the same
  command heals from the live group, which never stops; both end with the same weights; the script's own checks
  of those claims fail with one line on a tampered copy of its folder.
* LocalSGD and DiLoCo train, synchronize every sync_steps (logged), and resume from their checkpoints bit for bit.
* What ends a run is one line: no lighthouse at start, the lighthouse lost mid-run, fewer groups than
  min_replica_size for too long, a heal source dying mid-transfer, groups on different configs, a group whose
  weights drifted from the others' (a test hook changes one weight).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("torchft")

from tests.support.ft_groups import FtJob, errors, log, metrics  # noqa: E402
from tests.support.matrix import AC_EVERY_2ND, GRAD_NORM_RTOL, ROWS, RTOL, MatrixLaunches  # noqa: E402
from tests.support.runs import COMMON, ROOT, trainer_argv  # noqa: E402

pytestmark = [pytest.mark.distributed]

ROW = {r.name: r for r in ROWS}
CKPT = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "3"]
DEADLINE_S = 120  # every wait of this module ends by then: a stuck run fails instead of hanging CI


def _argv(folder: str, replica: int, groups: int, *extra: str) -> list[str]:
    ft = ["--fault_tolerance.enable", "--fault_tolerance.group_size", str(groups)]
    return trainer_argv([*extra, *ft, "--fault_tolerance.replica_id", str(replica)], folder)


def _replica(folder: str, i: int) -> str:
    return os.path.join(folder, f"replica_{i}")


def _the_error(results: list) -> str:
    """The one-line message a failed group's ranks raised (the last line of each traceback)."""
    found = errors(results)
    assert found, "the group was expected to fail"
    lines = {e.strip().splitlines()[-1] for e in found}
    assert len(lines) == 1, lines
    return lines.pop()


def _wait(what: str, predicate, timeout_s: float = DEADLINE_S, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def _last_step(folder: str) -> int:
    records = metrics(folder)
    return records[-1]["step"] if records else 0


def _check_parity(run: list[dict], want: dict[str, list[float]], name: str) -> None:
    assert [r["step"] for r in run] == list(range(1, len(want["loss"]) + 1)), name
    for r, loss, norm in zip(run, want["loss"], want["grad_norm"], strict=True):
        assert abs(r["loss"] - loss) <= RTOL * abs(loss), f"{name} step {r['step']}: loss {r['loss']} vs HSDP {loss}"
        assert abs(r["grad_norm"] - norm) <= GRAD_NORM_RTOL * norm, f"{name} step {r['step']}: grad norm"
        assert r["replica_groups"] == 2 and r["global_batch_samples"] == 8, r


# --------------------------------------------------------------------------- parity with HSDP, resume


def test_two_groups_of_one_rank_are_ddp2_and_resume_after_a_full_stop(tmp_path, matrix: MatrixLaunches):
    want = matrix.losses(ROW["ddp2"])  # replicate 2 x 1 rank, 4 samples each
    folder = str(tmp_path / "ft")
    with FtJob(2, 1, min_replicas=2) as job:  # both groups in the first quorum: no heal at step 1
        results = job.run([_argv(folder, i, 2, "--training.batch_size", "4", *CKPT) for i in (0, 1)])
        assert not errors(results[0]) and not errors(results[1]), errors(results[0] + results[1])
        first = [metrics(_replica(folder, i)) for i in (0, 1)]
        for i in (0, 1):
            _check_parity(first[i], want, f"group {i}")
            assert "other weights" not in log(_replica(folder, i))  # the weights fingerprints agreed every step
        # the shared checkpoint: the lowest live group writes it, with both groups' data positions
        assert "checkpoint step-3 complete" in log(_replica(folder, 0))
        assert "checkpoint step-3 complete" not in log(_replica(folder, 1))
        assert sorted(os.listdir(os.path.join(folder, "checkpoint"))) == ["step-3", "step-6"]
        # a full stop, then both groups again from step 3 (group 0 sets the later step-6 aside)
        again = [
            _argv(folder, i, 2, "--training.batch_size", "4", *CKPT, "--checkpoint.load_step", "3") for i in (0, 1)
        ]
        results = job.run(again)
        assert not errors(results[0]) and not errors(results[1]), errors(results[0] + results[1])
        for i in (0, 1):
            resumed = metrics(_replica(folder, i))
            assert [r["step"] for r in resumed] == list(range(1, 7))
            assert [r["loss"] for r in resumed[3:]] == [r["loss"] for r in first[i][3:]], f"group {i} after resume"
            assert "resumed from step 3" in log(_replica(folder, i))


def test_two_groups_of_two_ranks_with_fsdp_are_hsdp_2x2(tmp_path, matrix: MatrixLaunches):
    row = ROW["hsdp_2x2_ac_every_2nd"]  # replicate 2 x shard 2, 2 samples a rank, AC on every 2nd block
    want = matrix.losses(row)
    folder = str(tmp_path / "ft")
    with FtJob(2, 2, min_replicas=2) as job:
        results = job.run([_argv(folder, i, 2, "--training.batch_size", "2", *AC_EVERY_2ND) for i in (0, 1)])
    assert not errors(results[0]) and not errors(results[1]), errors(results[0] + results[1])
    digests = []
    for i in (0, 1):
        _check_parity(metrics(_replica(folder, i)), want, f"group {i}")
        digests += re.findall(r"weights digest (\w+)", log(_replica(folder, i)))
    assert len(digests) == 2 and digests[0] == digests[1], digests


def test_a_late_group_of_two_ranks_heals_its_fsdp_shards(tmp_path):
    """A heal sends each rank's own shards (DTensor local tensors) and optimizer state to its counterpart."""
    folder = str(tmp_path / "ft")
    with FtJob(2, 2, min_replicas=1) as job:
        first = job.start(0, _argv(folder, 0, 2, "--training.batch_size", "2", "--training.steps", "30"))
        _wait("group 0's first steps", lambda: _last_step(_replica(folder, 0)) >= 3)
        late = job.start(1, _argv(folder, 1, 2, "--training.batch_size", "2", "--training.steps", "30"))
        results = [first.result(timeout=DEADLINE_S), late.result(timeout=DEADLINE_S)]
    assert not errors(results[0]) and not errors(results[1]), errors(results[0] + results[1])
    healed = re.findall(r"replica group 1 healed from group 0 at step (\d+)", log(_replica(folder, 1)))
    assert len(healed) == 1 and int(healed[0]) >= 3, healed
    digests = [re.findall(r"with groups \[0, 1\]; weights digest (\w+)", log(_replica(folder, i))) for i in (0, 1)]
    assert digests[0] and digests[0] == digests[1], digests
    assert [r["step"] for r in metrics(_replica(folder, 0))] == list(range(1, 31))


# --------------------------------------------------------------------------- a group killed and restarted


def _ft_local(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/ft_local.sh", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=2 * DEADLINE_S,
    )


def test_ft_local_kills_a_group_which_heals_from_the_live_one_and_checks_its_claims(tmp_path):
    """scripts/ft_local.sh as docs/fault_tolerance.md runs it (the tests' tiny flavor, every step logged): it kills
    group 1 after step 3 and restarts it, holding group 0 back meanwhile so that no race with wall time decides
    the outcome; it checks its own claims; ``--check`` on a tampered copy of its folder fails with one line."""
    steps = 60
    dump = tmp_path / "ft"
    env = dict(DUMP=str(dump), PORT=str(_free_port()), KILL_STEP="3", OMP_NUM_THREADS="1", PREFLIGHT="0")
    argv = [*COMMON, "--training.steps", str(steps), "--training.batch_size", "4"]
    # an earlier job's files in the folder (group 1 logged its last step): moved aside, never read as this job's
    (dump / "replica_1").mkdir(parents=True)
    (dump / "replica_1" / "metrics.jsonl").write_text(json.dumps({"step": steps, "replica_groups": 2}) + "\n")
    result = _ft_local(*argv, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    summary = [line for line in result.stdout.splitlines() if line.startswith("ft_local: ")]
    assert len(summary) == 1 and summary[0].startswith("ft_local: ok: replica group 1 killed after step"), out
    assert (dump / "earlier_runs").is_dir() and "moved the earlier job" in result.stdout
    # what the script checked, read again here: the survivor trained every step once, alone for a while, losses
    # finite and falling; the restarted group healed from it after the kill; both ended on the same weights
    survivor, restarted = (dump / f"replica_{i}.log" for i in (0, 1))
    text0, text1 = survivor.read_text(), restarted.read_text()
    run = metrics(_replica(str(dump), 0))
    assert [r["step"] for r in run] == list(range(1, steps + 1))
    losses = [r["loss"] for r in run]
    assert all(math.isfinite(x) for x in losses) and sum(losses[-10:]) < sum(losses[:10]) - 3.0, losses
    assert "Traceback" not in text0 and "Error" not in text0
    left = [line for line in text0.splitlines() if "[1] left" in line or "retried with replica groups [0]" in line]
    assert len(left) == 1 and any(r["replica_groups"] == 1 for r in run) and run[-1]["replica_groups"] == 2, left
    record = json.loads((dump / "ft_local.json").read_text())
    healed = re.findall(r"replica group 1 healed from group 0 at step (\d+)", text1.split("replica group 1 of 2")[-1])
    assert len(healed) == 1 and int(healed[0]) > record["killed_after"] >= 3, (healed, record)
    assert text1.count("replica group 1 of 2") == 2 and _last_step(_replica(str(dump), 1)) == steps
    digests = [re.findall(r"done at step 60 with groups \[0, 1\]; weights digest (\w+)", t) for t in (text0, text1)]
    assert len(digests[0]) == 1 and digests[0] == digests[1][-1:], digests

    # its claims fail with one line: a divergence, a missing heal (the folder checked again, nothing run)
    def tampered(name: str, edit) -> subprocess.CompletedProcess:
        copy = tmp_path / name
        shutil.copytree(dump, copy)
        (copy / "replica_1.log").write_text(edit((copy / "replica_1.log").read_text()))
        return _ft_local("--check", str(copy))

    ok = _ft_local("--check", str(dump))
    assert ok.returncode == 0 and ok.stdout.strip() == summary[0], ok.stdout + ok.stderr
    diverged = tampered("diverged", lambda t: t.replace(f"weights digest {digests[0][0]}", "weights digest 0000"))
    healed_never = tampered("no_heal", lambda t: re.sub(r".*replica group 1 healed from group 0.*\n", "", t))
    for failed, says in ((diverged, "the groups ended on different weights"), (healed_never, "did not heal")):
        assert failed.returncode == 1 and failed.stdout == "", failed.stdout
        assert failed.stderr.count("\n") == 1 and says in failed.stderr, failed.stderr
    missing = _ft_local("--check", str(dump / "nothing_here"))
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "does not exist" in missing.stderr
    # a KILL_STEP that leaves the restarted group no steps to heal into: refused before anything starts
    late = _ft_local(*COMMON, "--training.steps", "10", env={**env, "DUMP": str(tmp_path / "late")})
    assert (
        late.returncode == 2 and late.stderr.count("\n") == 1 and "KILL_STEP = 3 with training.steps 10" in late.stderr
    )
    assert not (tmp_path / "late").exists(), late.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- semi-synchronous training


@pytest.mark.parametrize("method", ["local_sgd", "diloco"])
def test_semi_sync_trains_syncs_at_its_interval_and_resumes_bit_exact(tmp_path, method):
    folder = str(tmp_path / method)
    extra = ["--training.batch_size", "4", "--training.steps", "8", "--fault_tolerance.semi_sync_method", method]
    extra += ["--fault_tolerance.sync_steps", "2", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "4"]
    with FtJob(2, 1, min_replicas=2) as job:  # every synchronization waits for both groups
        results = job.run([_argv(folder, i, 2, *extra) for i in (0, 1)])
        assert not errors(results[0]) and not errors(results[1]), errors(results[0] + results[1])
        first = [metrics(_replica(folder, i)) for i in (0, 1)]
        for i in (0, 1):
            text = log(_replica(folder, i))
            synced = [int(s) for s in re.findall(rf"step (\d+): {method} synchronization \d+ ", text)]
            assert synced == [2, 4, 6, 8], synced
            losses = [r["loss"] for r in first[i]]
            assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3, losses
            # each group its own checkpoints (their optimizers differ)
            assert sorted(os.listdir(os.path.join(folder, "checkpoint", f"replica_{i}"))) == ["step-4", "step-8"]
        # the groups train apart between synchronizations: their losses differ, their weights after one agree
        assert [r["loss"] for r in first[0]] != [r["loss"] for r in first[1]]
        digests = [re.findall(r"weights digest (\w+)", log(_replica(folder, i))) for i in (0, 1)]
        assert digests[0] == digests[1] and len(digests[0]) == 1, digests
        results = job.run([_argv(folder, i, 2, *extra, "--checkpoint.load_step", "4") for i in (0, 1)])
        assert not errors(results[0]) and not errors(results[1]), errors(results[0] + results[1])
        for i in (0, 1):
            resumed = metrics(_replica(folder, i))
            assert [r["loss"] for r in resumed[4:]] == [r["loss"] for r in first[i][4:]], f"group {i} after resume"


# --------------------------------------------------------------------------- one line for each way it ends


def test_no_lighthouse_at_start_is_one_line_and_exit_code_5(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", OMP_NUM_THREADS="1")
    argv = [*COMMON, "--fault_tolerance.enable", "--fault_tolerance.group_size", "1"]
    argv += ["--fault_tolerance.quorum_timeout_seconds", "1", "--job.dump_folder", str(tmp_path / "ft")]
    cmd = [sys.executable, "-m", "torchtitan.train", "--job.config_file", "./train_configs/debug_model.toml", *argv]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert result.returncode == 5, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"the lighthouse at http://127.0.0.1:{port} (TORCHFT_LIGHTHOUSE) is unreachable" in lines[0], lines


def test_losing_the_lighthouse_mid_run_is_one_line(tmp_path):
    folder = str(tmp_path / "ft")
    extra = ["--training.steps", "400", "--fault_tolerance.quorum_timeout_seconds", "2"]
    with FtJob(1, 1, min_replicas=1) as job:
        future = job.start(0, _argv(folder, 0, 1, *extra))
        _wait("the first steps", lambda: _last_step(_replica(folder, 0)) >= 2)
        job.stop_lighthouse()
        message = _the_error(future.result(timeout=DEADLINE_S))
    assert re.search(r"fault tolerance: lost the lighthouse at http://127\.0\.0\.1:\d+ before step \d+", message), (
        message
    )


def test_fewer_groups_than_min_replica_size_for_too_long_is_one_line(tmp_path):
    folder = str(tmp_path / "ft")
    extra = ["--fault_tolerance.min_replica_size", "2", "--fault_tolerance.quorum_timeout_seconds", "2"]
    with FtJob(1, 1, min_replicas=1) as job:  # group 1 never comes
        message = _the_error(job.start(0, _argv(folder, 0, 2, *extra)).result(timeout=DEADLINE_S))
    assert "no step committed for" in message and "stuck at step 1" in message, message
    assert "1 live replica group(s), fewer than fault_tolerance.min_replica_size = 2" in message, message


def _pause_serving(marker: str) -> dict:
    open(marker, "w").close()
    time.sleep(DEADLINE_S)
    return {}


def pausing_replicas(core, *, marker: str):
    """A ``group_seams`` slot whose group hands its state to a healing group only after a long pause, announced in
    ``marker`` (torchft gathers every registered state before serving): the test kills it then."""
    from torchtitan.features.fault_tolerance.setup import build_replicas

    replicas = build_replicas(core)
    replicas.manager.register_state_dict_fn("test_pause", lambda state: None, functools.partial(_pause_serving, marker))
    return replicas


def test_a_heal_source_dying_mid_transfer_is_one_line(tmp_path):
    from torchtitan.engine.builders import Builders

    folder, marker = str(tmp_path / "ft"), str(tmp_path / "serving")
    extra = ["--training.steps", "400", "--fault_tolerance.quorum_timeout_seconds", "10"]
    with FtJob(2, 1, min_replicas=1) as job:
        builders = Builders(overrides={"group_seams": functools.partial(pausing_replicas, marker=marker)})
        source = job.start(0, _argv(folder, 0, 2, *extra), builders=builders)
        _wait("group 0's first steps", lambda: _last_step(_replica(folder, 0)) >= 3)
        healing = job.start(1, _argv(folder, 1, 2, *extra))
        _wait("group 0 to start serving its state", lambda: os.path.exists(marker))
        job.pools[0].kill()  # mid-transfer: group 1 is fetching
        message = _the_error(healing.result(timeout=DEADLINE_S))
        with pytest.raises(Exception):  # noqa: B017 - the killed pool: PoolBroken
            source.result(timeout=DEADLINE_S)
    assert re.search(r"replica group 1 was healing to step \d+ when its source failed, and no live group", message)
    assert "could not heal to step" in log(_replica(folder, 1))


def test_groups_on_different_configs_are_one_line(tmp_path):
    folder = str(tmp_path / "ft")
    timeout = ["--fault_tolerance.quorum_timeout_seconds", "3"]
    with FtJob(2, 1, min_replicas=2) as job:  # both in the first quorum: the step's config check, not a heal
        results = job.run([_argv(folder, i, 2, "--training.seed", str(42 + i), *timeout) for i in (0, 1)])
    # the group that differs from the lowest live one stops; group 0 then has no quorum of 2 (the lighthouse's)
    assert "fault tolerance: replica group 1 runs another config than group 0" in _the_error(results[1])
    assert "fault tolerance: no quorum for step" in _the_error(results[0])


def nudging_replicas(core, *, step: int, marker: str):
    """The ``group_seams`` slot; at the first commit from ``step`` on that both groups train, one weight of this rank is
    changed by 1e-3 (a silent fault), and ``marker`` gets that step."""
    from torchtitan.features.fault_tolerance.setup import build_replicas

    replicas = build_replicas(core)
    commit = replicas.commit

    def nudged_commit(at: int) -> bool:
        if at >= step and replicas.members == (0, 1) and not os.path.exists(marker):
            weight = next(core.model_parts[0].parameters())
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            with torch.no_grad():
                local.view(-1)[0] += 1e-3
            with open(marker, "w") as f:
                f.write(str(at))
        return commit(at)

    replicas.commit = nudged_commit
    return replicas


def test_a_group_whose_weights_drift_apart_stops_in_one_line(tmp_path):
    from torchtitan.engine.builders import Builders

    folder, marker = str(tmp_path / "ft"), str(tmp_path / "nudged")
    extra = ["--training.batch_size", "4", "--training.steps", "20", "--fault_tolerance.quorum_timeout_seconds", "3"]
    with FtJob(2, 1, min_replicas=2) as job:  # both in every quorum: the step's check, not a heal
        nudging = Builders(overrides={"group_seams": functools.partial(nudging_replicas, step=3, marker=marker)})
        results = [job.start(0, _argv(folder, 0, 2, *extra)), job.start(1, _argv(folder, 1, 2, *extra), nudging)]
        results = [r.result(timeout=DEADLINE_S) for r in results]
    with open(marker) as f:
        assert f.read() == "3"
    # element 0 of the first weight is in slice 0: read at step 16 (SLICES), the first such step after the change
    message = _the_error(results[1])
    want = "replica group 1's weights differ from replica group(s) [0] at the start of step 16 (weights fingerprint "
    assert want in message, message
    said = [line for line in log(_replica(folder, 0)).splitlines() if "hold other weights" in line]
    assert (
        len(said) == 1 and "replica group(s) [1] hold other weights than this group at the start of step 16:" in said[0]
    )
    # group 0 would go on alone; this lighthouse asks for 2 groups in a quorum, so it stops for want of one
    assert "fault tolerance: no quorum for step 16" in _the_error(results[0])
    assert [r["step"] for r in metrics(_replica(folder, 0))] == list(range(1, 16))
