"""Fault tolerance through the trainer (docs/fault_tolerance.md): torchft replica groups on CPU/gloo, a lighthouse
on loopback. Skipped where torchft (the ``ft`` extra) is not installed.

* Parity: 2 groups x 1 rank and 2 groups x 2 ranks (FSDP inside) train, step for step, as the matrix's DDP2 and
  HSDP 2x2 rows (replicate 2): losses within the matrix's 1e-5, grad norms within its 3e-4; the shared
  checkpoint is written by group 0 alone, and both groups resume from it after a full stop, bit for bit.
* A group SIGKILLed (its whole process group, through run_llama_train.sh) and restarted with the same command
  heals from the live group, which never stops; both end with the same weights.
* LocalSGD and DiLoCo train, synchronize every sync_steps (logged), and resume from their checkpoints bit for bit.
* What ends a run is one line: no lighthouse at start, the lighthouse lost mid-run, fewer groups than
  min_replica_size for too long, a heal source dying mid-transfer, groups on different configs, a group whose
  weights drifted from the others' (a test hook changes one weight).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("torchft")

from tests.ft_groups import LIGHTHOUSE, FtJob, errors, log, metrics  # noqa: E402
from tests.integration_tests import (  # noqa: E402
    AC_EVERY_2ND,
    COMMON,
    GRAD_NORM_RTOL,
    ROOT,
    ROWS,
    RTOL,
    MatrixLaunches,
    trainer_argv,
)
from torchtitan.fault_tolerance.lighthouse import start_lighthouse  # noqa: E402

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


def _launch(folder: str, replica: int, steps: int, lighthouse: str, out) -> subprocess.Popen:
    """One replica group as a user starts it: run_llama_train.sh, its own process group."""
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse, NGPU="1", PREFLIGHT="0", OMP_NUM_THREADS="1")
    argv = [*COMMON, "--training.steps", str(steps), "--training.batch_size", "4"]
    argv += ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id"]
    cmd = ["bash", "./run_llama_train.sh", *argv, str(replica), "--job.dump_folder", folder]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def _paused(pid: int):
    """SIGSTOP a rank, SIGCONT it on exit: the survivor waits while the other group starts (a launch takes ~5 s
    on 2 cores, in which a tiny model's group trains over a hundred steps alone), instead of the test racing the
    other's start against the survivor's last step. It stays one run: the same process, each of its steps once."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _rank_pid(out, group: int) -> int | None:
    """The pid of a group's rank once its Manager is up (torchrun starts ranks in sessions of their own, so a
    signal to the launcher's process group does not reach them; a killed launcher's rank stops by itself)."""
    out.flush()
    with open(out.name) as f:
        found = re.search(rf"fault tolerance: replica group {group} of 2 \(1 rank, pid (\d+)\)", f.read())
    return int(found.group(1)) if found else None


def test_a_killed_group_heals_from_the_live_one_which_never_stops(tmp_path):
    steps = 80
    folder = str(tmp_path / "ft")
    lock = os.path.join(_replica(folder, 1), "run.lock")  # a launch's first file, seconds before its first step
    lighthouse, address = start_lighthouse(1, **LIGHTHOUSE)
    outs = [open(tmp_path / name, "w+") for name in ("group0.out", "group1.out", "group1_restarted.out")]
    procs = []
    try:
        procs.append(_launch(folder, 0, steps, address, outs[0]))
        _wait("group 0's start", lambda: _rank_pid(outs[0], 0) is not None)
        survivor = _rank_pid(outs[0], 0)
        _wait("group 0's first step", lambda: _last_step(_replica(folder, 0)) >= 1, poll_s=0.01)
        # group 0 waits while group 1 starts, and goes on once group 1 has its run folder: it is back in the
        # lighthouse's quorums long before group 1's first one, so group 1 joins behind it and heals from it
        with _paused(survivor):
            procs.append(_launch(folder, 1, steps, address, outs[1]))
            _wait("group 1's run folder", lambda: os.path.exists(lock), poll_s=0.01)
        _wait("group 1 to train a few steps", lambda: len(metrics(_replica(folder, 1))) >= 3, poll_s=0.01)
        # group 0 waits while group 1 is killed: on a loaded machine it could otherwise finish every step before the
        # kill is reaped, leaving no step to train alone
        with _paused(survivor):
            os.killpg(procs[1].pid, signal.SIGKILL)  # what a user's kill of the job does: the launcher's group
            os.kill(_rank_pid(outs[1], 1), signal.SIGKILL)  # and the rank at once (its parent watch: ~1 s later)
            procs[1].wait(timeout=DEADLINE_S)
            killed_at, survivor_at = _last_step(_replica(folder, 1)), _last_step(_replica(folder, 0))

        def alone() -> list[dict]:  # group 0's steps after the kill, trained without group 1
            return [r for r in metrics(_replica(folder, 0)) if r["step"] > survivor_at and r["replica_groups"] == 1]

        _wait("group 0 to train on alone", lambda: len(alone()) >= 3, poll_s=0.01)
        with _paused(survivor):  # group 0 alone: a pause only delays it (group 1 restarts behind it either way)
            procs.append(_launch(folder, 1, steps, address, outs[2]))  # the same command
            _wait("group 1's restart", lambda: _rank_pid(outs[2], 1) is not None)
        codes = [procs[0].wait(timeout=DEADLINE_S), procs[2].wait(timeout=DEADLINE_S)]
    except AssertionError as e:  # a wait timed out: show what the groups said
        tails = []
        for out in outs:
            out.flush()
            with open(out.name) as f:
                tails.append(f"--- {os.path.basename(out.name)}\n" + "".join(f.readlines()[-25:]))
        raise AssertionError(f"{e}\n" + "\n".join(tails)) from None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        lighthouse.kill()
    text = []
    for out in outs:
        out.seek(0)
        text.append(out.read())
    assert codes == [0, 0], f"exit codes {codes}\n{text[0][-3000:]}\n{text[2][-3000:]}"
    # the survivor: one start, every step once, losses finite and falling; the failure told in one line
    assert text[0].count("fault tolerance: replica group 0 of 2") == 1, "group 0 restarted"
    run = metrics(_replica(folder, 0))
    assert [r["step"] for r in run] == list(range(1, steps + 1))
    losses = [r["loss"] for r in run]
    assert all(math.isfinite(x) for x in losses) and sum(losses[-10:]) < sum(losses[:10]) - 3.0, losses
    assert "Traceback" not in text[0] and "Error" not in text[0]
    left = [line for line in text[0].splitlines() if "[1] left" in line or "retried with replica groups [0]" in line]
    assert len(left) == 1, left
    assert alone() and run[-1]["replica_groups"] == 2
    # the restarted group healed from group 0 after the kill and ended with the same weights
    healed = re.findall(r"replica group 1 healed from group 0 at step (\d+)", text[2])
    assert len(healed) == 1 and int(healed[0]) > killed_at, (healed, killed_at)
    assert _last_step(_replica(folder, 1)) == steps
    digests = [
        re.findall(r"done at step \d+ with groups \[0, 1\]; weights digest (\w+)", t) for t in (text[0], text[2])
    ]
    assert digests[0] and digests[0] == digests[1], digests


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
    """A ``replicas`` seam whose group hands its state to a healing group only after a long pause, announced in
    ``marker`` (torchft gathers every registered state before serving): the test kills it then."""
    from torchtitan.fault_tolerance.setup import build_replicas

    replicas = build_replicas(core)
    replicas.manager.register_state_dict_fn("test_pause", lambda state: None, functools.partial(_pause_serving, marker))
    return replicas


def test_a_heal_source_dying_mid_transfer_is_one_line(tmp_path):
    from torchtitan.engine.builders import Builders

    folder, marker = str(tmp_path / "ft"), str(tmp_path / "serving")
    extra = ["--training.steps", "400", "--fault_tolerance.quorum_timeout_seconds", "10"]
    with FtJob(2, 1, min_replicas=1) as job:
        builders = Builders(overrides={"outer": functools.partial(pausing_replicas, marker=marker)})
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
    """The ``replicas`` seam; at the first commit from ``step`` on that both groups train, one weight of this rank is
    changed by 1e-3 (a silent fault), and ``marker`` gets that step."""
    from torchtitan.fault_tolerance.setup import build_replicas

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
        nudging = Builders(overrides={"outer": functools.partial(nudging_replicas, step=3, marker=marker)})
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
