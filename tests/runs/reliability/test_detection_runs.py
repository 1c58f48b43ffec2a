"""Quiet faults told in one line (docs/reliability.md, "Detections"), through the real trainer and launcher.

* A straggler: a test hook makes rank 1 of a 2-rank pool job sleep in every step; with
  ``metrics.straggler_factor`` the run names it in one warning line and metrics.jsonl carries the slowest rank
  and the spread; a clean run with the watch on names no rank; both train to the losses of a run without it,
  bit for bit.
* A lost node: two launchers (``python -m torchtitan.launch --nnodes 2``, c10d rendezvous on a free port,
  one rank each) train; one "node" (its launcher's process group and its rank) is SIGKILLed; the other exits
  non-zero within a bounded time with one line naming the lost node and the checkpoint to resume from, and no
  traceback; a clean two-node run ends with 0 and the losses of the same run as one 2-rank pool job, bit for bit.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.support.pool import run_in_pool, train_job
from tests.support.runs import COMMON, ROOT, complete_steps, read_metrics, trainer_argv

pytestmark = [pytest.mark.distributed, pytest.mark.pool(2)]

STRAGGLER = ["--metrics.straggler_factor", "2", "--metrics.straggler_log_steps", "3"]
SLEEP_S = 1.0  # against a step of 0.1-0.4 s on a loaded 2-core machine: a spread of 3.5-11


class _SlowRank:
    """The trainer's step guard; on rank ``rank`` every step first sleeps ``seconds`` (a slow rank)."""

    def __init__(self, core, metrics, signals, *, rank: int, seconds: float):
        from torchtitan.engine.builders import build_guard

        self.guard, self.slow = build_guard(core, metrics, signals), core.rank == rank
        self.seconds = seconds

    def check(self, step, loss, grad_norm):
        if self.slow:
            time.sleep(self.seconds)
        return self.guard.check(step, loss, grad_norm)


def _job(folder: str, *extra: str, builders=None) -> str:
    argv = trainer_argv(["--training.steps", "5", *extra], folder)
    results = run_in_pool(train_job, 2, argv, builders, name=f"train {os.path.basename(folder)}")
    assert results == [None, None], [r.error for r in results if r is not None]
    with open(os.path.join(folder, "rank0.log")) as f:
        return f.read()


def test_a_slow_rank_is_named_in_one_line_and_a_clean_run_is_not(tmp_path):
    from torchtitan.engine.builders import Builders

    off = str(tmp_path / "off")
    _job(off)
    clean, slowed = str(tmp_path / "clean"), str(tmp_path / "slowed")
    clean_log = _job(clean, *STRAGGLER)
    slow = Builders(guard=functools.partial(_SlowRank, rank=1, seconds=SLEEP_S))
    slowed_log = _job(slowed, *STRAGGLER, builders=slow)

    want = [r["loss"] for r in read_metrics(off)]
    for folder in (clean, slowed):  # the watch changes no number
        assert [r["loss"] for r in read_metrics(folder)] == want, folder
    assert "straggler" not in clean_log, clean_log
    assert all(r["rank_time_spread"] < 2 for r in read_metrics(clean))

    # the step named: the third in a row whose record says rank 1 is slower by the factor (step 1, which also
    # holds the ranks' warm-up, may not be)
    records = read_metrics(slowed)
    slow = [r["slowest_rank"] == 1 and r["rank_time_spread"] >= 2 for r in records]
    named = next(records[i + 2]["step"] for i in range(len(slow) - 2) if all(slow[i : i + 3]))
    assert all(slow[1:]), records
    lines = [line for line in slowed_log.splitlines() if "straggler" in line]
    assert len(lines) == 1, lines
    host = re.escape(socket.gethostname())
    pattern = (
        rf"WARNING straggler: rank 1 \(host {host}\) is [\d.]+x the median of the other ranks for 3 log steps in a "
        rf"row \(to step {named}\): [\d.]+ s a step busy, [\d.]+ s fetching data, against their [\d.]+ s and "
        r"[\d.]+ s; they wait [\d.]+ s a step for it \(metrics.straggler_factor = 2\)$"
    )
    assert re.search(pattern, lines[0]), lines[0]
    assert all(r["slowest_excess_s"] > SLEEP_S * 0.8 for r in records[1:]), records


# --------------------------------------------------------------------------- a lost node


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(port: int, folder: str, out, steps: int = 100000) -> subprocess.Popen:
    """One "node": scripts/multinode_trainer.slurm's launch with 2 nodes of 1 rank, on loopback."""
    launch = [sys.executable, "-m", "torchtitan.launch", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_id", "t"]
    launch += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--role", "rank", "--tee", "3"]
    train = ["-m", "torchtitan.train", "--job.config_file", "./train_configs/debug_model.toml", *COMMON]
    train += ["--training.steps", str(steps), "--checkpoint.enable_checkpoint", "--checkpoint.interval", "3"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [*launch, *train, "--job.dump_folder", folder]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _listening(port: int, node: subprocess.Popen, timeout_s: float = 120) -> None:
    """Wait until a socket listens on ``port`` (/proc/net/tcp*, state 0A: the rendezvous store node 0 hosts), so
    that the second node starts as soon as the store is there, and never before it."""
    deadline = time.monotonic() + timeout_s
    while True:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    _, local, _, state = line.split()[:4]
                    if state == "0A" and int(local.rpartition(":")[2], 16) == port:
                        return
        assert node.poll() is None, f"node 0 exited ({node.returncode}) before it hosted the store at port {port}"
        assert time.monotonic() < deadline, f"nothing listens on port {port} after {timeout_s:.0f} s"
        time.sleep(0.05)


def _rank_of(launcher: int) -> int:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == launcher:
                        return int(entry)
            except (OSError, ValueError):
                pass
    raise AssertionError(f"launcher {launcher} has no rank")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the ranks through /proc")
@pytest.mark.parametrize("lost", ["other", "rendezvous_host"])
def test_a_lost_node_is_one_line_naming_it_and_the_checkpoint(tmp_path, lost):
    port, folder = _free_port(), str(tmp_path / "run")
    outs = [open(tmp_path / f"node{i}.out", "w+") for i in (0, 1)]
    nodes = [_node(port, folder, outs[0])]
    try:
        _listening(port, nodes[0])  # node 0 hosts the rendezvous store (it binds the port first)
        nodes.append(_node(port, folder, outs[1]))
        deadline = time.monotonic() + 240
        while not (os.path.isdir(os.path.join(folder, "checkpoint")) and complete_steps(folder)):
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), "no checkpoint"
            time.sleep(0.5)
        dead, alive = (nodes[0], nodes[1]) if lost == "rendezvous_host" else (nodes[1], nodes[0])
        rank = _rank_of(dead.pid)
        start = time.monotonic()
        os.killpg(dead.pid, signal.SIGKILL)  # the whole node: its launcher's process group and its rank
        os.kill(rank, signal.SIGKILL)
        code = alive.wait(timeout=60)
        took = time.monotonic() - start
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    out = outs[nodes.index(alive)]
    out.seek(0)
    text = out.read()
    assert code == 7, text[-3000:]
    assert took < 20, f"the surviving node took {took:.1f} s to stop"
    hosted = f", which hosted the rendezvous at 127.0.0.1:{port}" if lost == "rendezvous_host" else ""
    step = complete_steps(folder)[-1]
    want = (
        f"error: lost node {socket.gethostname()} (launcher pid {dead.pid}){hosted}: it stopped answering for 3 s, "
        f"so this node's ranks were stopped; the same command on every node resumes from checkpoint step-{step} "
        f"({folder}/checkpoint/step-{step})"
    )
    assert [line for line in text.splitlines() if line.startswith("error")] == [want], text[-3000:]
    assert "Traceback" not in text and "frame #" not in text, text[-5000:]


def test_a_clean_two_node_run_ends_0_with_the_losses_of_one_node(tmp_path):
    """The watch runs in the launchers only: two nodes of one rank train as one 2-rank pool job, bit for bit."""
    port, folder, one = _free_port(), str(tmp_path / "two_nodes"), str(tmp_path / "one_node")
    outs = [open(tmp_path / f"node{i}.out", "w+") for i in (0, 1)]
    nodes = [_node(port, folder, outs[0], steps=4)]
    try:
        _listening(port, nodes[0])
        nodes.append(_node(port, folder, outs[1], steps=4))
        codes = [n.wait(timeout=240) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    text = []
    for out in outs:
        out.seek(0)
        text.append(out.read())
    assert codes == [0, 0], "\n".join(t[-3000:] for t in text)
    assert not any(line.startswith("error") for t in text for line in t.splitlines()), text
    argv = trainer_argv(["--training.steps", "4", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "3"], one)
    assert run_in_pool(train_job, 2, argv, name="train one_node") == [None, None]
    assert [r["loss"] for r in read_metrics(folder)] == [r["loss"] for r in read_metrics(one)]
