"""One pool of worker processes per world size for the whole test run.

Starting a rank costs more than most of what a test asks of it on the 2-core CI machine: Python
and torch import in ~3 s of CPU, and the two cores are shared by every rank. So each world size
gets N workers once (``pool(N)``): they join one gloo process group and then run *jobs* in
sequence, each ``fn(rank, world_size, *args)`` with ``fn`` importable by name:

* a harness function of tests/distributed (``run_distributed``),
* a trainer job: ``train_job`` runs ``torchtitan.train.run_job``, the trainer's own entry, with its
  own dump folder and per-rank log (the matrix rows, the single-process references as 1-rank jobs,
  resume pairs: train, stage, resume).

Isolation between jobs: determinism off, default dtype fp32, the once-per-process warnings cleared,
dynamo reset, garbage collected (over what jobs made: what the worker loaded first is frozen); the default
group stays, and so does the mesh of each layout a worker has built, with DTensor's sharding caches that name
it (tests/support/pool_meshes.py: the same mesh object for the next job of that layout, as for the steps of one run);
any other group a job made is destroyed and the caches cleared. A job that fails on any rank is reported and the
pool goes on once a ping (an all-reduce of the job's number) shows the ranks are still in step; a
rank that dies, a job past its deadline (each live rank first writes its Python stacks to the output the
failure shows), or a failed ping kills the pool, and the next job starts a fresh one. ``restart_after``
restarts it after the job: compile jobs (inductor keeps state) and in-loop lm-eval jobs (its libraries keep
native threads; a later job's rank segfaulted once after one).

Between its jobs a pool is stopped (SIGSTOP; SIGCONT before the next job, its close, a stack dump or the session's
exit). A worker keeps a gloo group per mesh axis of every layout it has run (up to ~20 on 4 and 8 ranks), and each
group's transport thread wakes ~100 times a second, busy or not: an idle 8-rank pool after three layouts burned 17%
of a core. The 4- and 8-rank pools live for nearly the whole session (their last users run near its end) and run
jobs for a tenth of it; stopped, they cost nothing while the other pools and the launcher tests run.

What keeps a process of its own, and why, is said where it is launched (signals, SIGKILL mid-save,
the parent watch, the golden run that pins the shell command, one case per exit path of the launcher).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.support import pool_meshes
from torchtitan.distributed.backend.device import ProcessFlags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB_DEADLINE_S = 600.0
PG_TIMEOUT_S = 300  # a collective waits this long for a peer (16 ranks on 2 cores compile slowly)
GRACE_S = 60.0  # once one rank has failed, how long the others may take to report
STACK_LINES = 80  # of each rank's output after a deadline: the stacks the ranks wrote (30 for other failures)
STATUS_FILE = "job_status.json"


@dataclass(frozen=True)
class JobFailed:
    """What a trainer job returns on a rank that raised (the parent decides: it may be expected)."""

    error: str


class PoolBroken(RuntimeError):
    """A rank died, a job ran past its deadline, or the ranks fell out of step: the pool was killed."""


@dataclass
class JobRecord:
    world_size: int
    name: str
    seconds: float
    ok: bool


@dataclass
class PoolStats:
    """What the pools cost this run: per job, and the seconds spent starting workers."""

    jobs: list[JobRecord] = field(default_factory=list)
    starts: dict[int, int] = field(default_factory=dict)
    start_seconds: dict[int, float] = field(default_factory=dict)


STATS = PoolStats()


_CONTEXT = None


def _context():
    """Workers fork from a server that imported torch and the trainer once (~4 s of CPU a rank saved).

    Also preloaded, what the first trainer job of every worker imported on its own: the text data path
    (``torchtitan.datasets.hf_datasets``: datasets, pyarrow, pandas) and ``scipy.io``, which datasets' streaming
    patch imports at the first ``load_dataset``. Measured: a worker's first fsdp2 job 1.43 -> 0.86 CPU-s (later
    jobs 0.6), a fresh 8-rank matrix job 11.5 -> 8.9 s on 2 cores; a CI run starts ~100 workers (estimated: every world
    size, the restarts, fault tolerance's groups).

    The server is a fresh interpreter (not a fork of pytest's), so it holds no locks of the test process. Its
    threads: torch's, and pyarrow's jemalloc purge thread (jemalloc takes its locks around fork, in its
    pthread_atfork handlers); 150 pools of 2 forked from it, each allocating through pyarrow and torch, ran clean."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(
            ["torchtitan.train", "tests.support.pool", "torchtitan.datasets.hf_datasets", "scipy.io"]
        )
    return _CONTEXT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reset_between_jobs(flags: ProcessFlags) -> None:
    """What one job may leave behind that would change the next one."""
    from torchtitan.observability.logging import warn_once

    # Deterministic kernels, oneDNN: a Trainer puts back what it found when closed, a job that builds none may not
    flags.restore()
    torch.set_default_dtype(torch.float32)
    warn_once.cache_clear()
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    gc.collect()


def _serve(rank: int, world_size: int, port: int, out_path: str, jobs, results) -> None:
    """A worker: join the group, then run jobs until told to stop (None)."""
    # the worker's own output goes to a file the parent shows when a job fails (not into a test's capture)
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks before killing a stuck job
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.chdir(ROOT)  # the tests name configs and assets relative to the repository
    torch.set_num_threads(1)
    import torch.distributed as dist

    from torchtitan.observability.logging import init_logger

    init_logger()
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=PG_TIMEOUT_S))
    pool_meshes.install(dist.group.WORLD)
    results.put((0, rank, "ok", "ready"))
    flags = ProcessFlags.read()  # as the worker started
    # What the worker holds now (torch, the trainer, the group) lives as long as it does: out of the collector's
    # sight, the full collection after every job scans only what jobs made (~0.24 -> 0.01 CPU-s a rank a job)
    gc.freeze()
    try:
        while (job := jobs.get()) is not None:
            seq, fn, args = job
            if fn is None:  # the ping: are the ranks still in step?
                t = torch.tensor([seq])
                dist.all_reduce(t)
                results.put((seq, rank, "ok", int(t.item())))
                continue
            failed = True
            try:
                _reset_between_jobs(flags)
                value = fn(rank, world_size, *args)
                failed = isinstance(value, JobFailed)
                results.put((seq, rank, "ok", value))
            except BaseException:  # noqa: BLE001 - reported to the parent, the worker goes on
                results.put((seq, rank, "error", traceback.format_exc()))
            finally:  # groups the job made (they hold sockets to every peer) and the caches naming them
                pool_meshes.end_job(failed)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class WorkerPool:
    """N workers in one gloo group, running jobs one after the other."""

    def __init__(self, world_size: int):
        start = time.perf_counter()
        self.world_size = world_size
        ctx = _context()
        self._results = ctx.SimpleQueue()
        self._jobs = [ctx.SimpleQueue() for _ in range(world_size)]
        self._dir = tempfile.mkdtemp(prefix=f"torchtitan-pool{world_size}-")
        self.out_paths = [os.path.join(self._dir, f"rank{r}.out") for r in range(world_size)]
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(r, world_size, port, self.out_paths[r], self._jobs[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._seq = 0
        self._stopped = False
        _EVERY_POOL.add(self)  # the shared ones and those of their own (fault tolerance's groups, a kill test's)
        self._collect(0, JOB_DEADLINE_S)  # every rank has joined the group
        self._stop()
        STATS.starts[world_size] = STATS.starts.get(world_size, 0) + 1
        STATS.start_seconds[world_size] = STATS.start_seconds.get(world_size, 0.0) + time.perf_counter() - start

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def _signal(self, sig: int) -> bool:
        """``sig`` to every live worker; whether any got it."""
        signalled = False
        for p in self._procs:
            if p.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(p.pid, sig)
                    signalled = True
        return signalled

    def _stop(self) -> None:
        """Idle: every worker stopped (the module's docstring: why). Only between jobs, when every rank has replied,
        so no collective is in flight; a rank still tidying up after its reply finishes when continued."""
        self._signal(signal.SIGSTOP)
        self._stopped = True

    def _continue(self) -> None:
        if self._stopped:
            self._signal(signal.SIGCONT)
            self._stopped = False

    def run(self, fn: Callable, *args, timeout_s: float = JOB_DEADLINE_S, name: str | None = None) -> list:
        """fn(rank, world_size, *args) on every rank; returns the results by rank.

        Raises RuntimeError (with every failed rank's traceback) when a rank raised, PoolBroken when
        the pool had to be killed (it is unusable afterwards).
        """
        start = time.perf_counter()
        self._continue()
        self._seq += 1
        for q in self._jobs:
            q.put((self._seq, fn, args))
        replies = self._collect(self._seq, timeout_s)
        errors = [f"rank {r}:\n{value}" for r, (status, value) in sorted(replies.items()) if status == "error"]
        failed = errors or any(isinstance(value, JobFailed) for _, value in replies.values())
        seconds = time.perf_counter() - start
        STATS.jobs.append(JobRecord(self.world_size, name or fn.__qualname__, seconds, not failed))
        if failed:  # a rank stopped early: are the others still in step with it?
            self._check_in_step()
        self._stop()
        if errors:
            raise RuntimeError("distributed run failed\n" + "\n".join(errors))
        return [replies[r][1] for r in range(self.world_size)]

    def _collect(self, seq: int, timeout_s: float) -> dict[int, tuple[str, object]]:
        deadline = time.monotonic() + timeout_s
        replies: dict[int, tuple[str, object]] = {}
        while len(replies) < self.world_size:
            if time.monotonic() > deadline:
                self._dump_stacks()
                self.kill()
                what = f"job exceeded {timeout_s:.0f}s (a rank is probably stuck in a collective)"
                raise PoolBroken(self._why(what, replies, lines=STACK_LINES))
            if self._results.empty():
                if not self.alive():
                    time.sleep(0.5)  # a dying rank may still have queued its traceback
                    if self._results.empty():
                        codes = [p.exitcode for p in self._procs]
                        self.kill()
                        raise PoolBroken(self._why(f"a rank died: exit codes {codes}", replies))
                    continue
                time.sleep(0.02)
                continue
            got_seq, rank, status, value = self._results.get()
            if got_seq != seq:  # a late reply of an earlier, failed job
                continue
            replies[rank] = (status, value)
            if status == "error" or isinstance(value, JobFailed):  # the others finish soon, or wait for this rank
                deadline = min(deadline, time.monotonic() + GRACE_S)
        return replies

    def _check_in_step(self) -> None:
        """After a failed job: every rank all-reduces the job's number; anything else kills the pool."""
        self._seq += 1
        for q in self._jobs:
            q.put((self._seq, None, ()))
        try:
            replies = self._collect(self._seq, GRACE_S)
        except PoolBroken:
            return
        if any(value != self._seq * self.world_size for _, value in replies.values()):
            self.kill()

    def _why(self, what: str, replies: dict, lines: int = 30) -> str:
        """The failure message: what happened, each failed rank's traceback, the last ``lines`` of each rank's
        output."""
        tails = []
        for r, path in enumerate(self.out_paths):
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                tails.append(f"--- rank {r} output (last lines)\n" + "".join(f.readlines()[-lines:]))
        errors = [f"rank {r}:\n{value}" for r, (status, value) in sorted(replies.items()) if status == "error"]
        return "\n".join([f"pool of {self.world_size}: {what}", *errors, *tails])

    def _dump_stacks(self) -> None:
        """Every live rank writes its Python stacks (all threads) to its output: where it is stuck."""
        self._continue()
        if self._signal(signal.SIGUSR1):
            time.sleep(2)  # faulthandler writes from the signal handler; a loaded rank may take a moment to run it

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._stopped = False

    def close(self, wait: bool = True) -> None:
        """Tell the workers to leave; ``wait=False`` lets them exit while the next test runs."""
        self._continue()
        for q in self._jobs:
            with contextlib.suppress(Exception):
                q.put(None)
        if wait:
            for p in self._procs:
                p.join(timeout=30)
            self.kill()
        else:
            _CLOSING.append(self)


_POOLS: dict[int, WorkerPool] = {}
_CLOSING: list[WorkerPool] = []  # told to leave, reaped at the end of the run


_EVERY_POOL: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


@atexit.register  # before multiprocessing's own exit handler (registered earlier, so run later) terminates the
def _continue_stopped() -> None:  # daemon workers and joins them: a stopped one would not die of SIGTERM
    for p in list(_EVERY_POOL):
        p._continue()


def pool(world_size: int) -> WorkerPool:
    """The run's pool of ``world_size`` workers, started on first use (again after it broke)."""
    live = _POOLS.get(world_size)
    if live is None or not live.alive():
        if live is not None:
            live.kill()
        _POOLS[world_size] = live = WorkerPool(world_size)
    return live


def close_pool(world_size: int, wait: bool = True) -> None:
    live = _POOLS.pop(world_size, None)
    if live is not None:
        live.close(wait=wait)


def close_all() -> None:
    for world_size in list(_POOLS):
        close_pool(world_size)
    while _CLOSING:
        _CLOSING.pop().close()


def live_world_sizes() -> list[int]:
    return sorted(_POOLS)


def run_in_pool(
    fn: Callable,
    world_size: int,
    *args,
    timeout_s: float = JOB_DEADLINE_S,
    restart_after: bool = False,
    name: str | None = None,
):
    """``pool(world_size).run(fn, *args)``; the pool is restarted afterwards if asked (or if it broke)."""
    try:
        return pool(world_size).run(fn, *args, timeout_s=timeout_s, name=name)
    finally:
        if restart_after:
            close_pool(world_size)


# ---- trainer jobs ------------------------------------------------------------------------------


def _dump_folder(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--job.dump_folder":
            return argv[i + 1]
        if arg.startswith("--job.dump_folder="):
            return arg.split("=", 1)[1]
    raise ValueError(f"job without --job.dump_folder: {argv}")


def train_job(rank: int, world_size: int, argv: list[str], builders: Any = None) -> JobFailed | None:
    """One trainer run on this rank, as torchtitan.train would run it; returns None or what it raised.

    The rank's log goes to ``<run folder>/rank<r>.log`` (the step lines, the warnings, the summary): the dump
    folder, or a fault-tolerant replica group's own folder in it. ``builders``: the trainer's (a test's fault
    injection), default a real run.
    """
    from torchtitan.config.manager import JobConfig
    from torchtitan.launch.run_folder import run_folder
    from torchtitan.train import run_job

    try:
        config = JobConfig.parse_args(argv, world_size=world_size)
        folder = run_folder(config)
    except BaseException:  # noqa: BLE001 - a config error is the job's result, logged beside its dump folder
        config, folder = None, _dump_folder(argv)
    os.makedirs(folder, exist_ok=True)
    handler = logging.FileHandler(os.path.join(folder, f"rank{rank}.log"), mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logging.getLogger().addHandler(handler)
    try:
        if config is None:
            JobConfig.parse_args(argv, world_size=world_size)  # raises the config error again, into the log
        run_job(config, world_size=world_size, rank=rank, builders=builders)
        return None
    except BaseException:  # noqa: BLE001 - the parent decides (a job may be expected to fail)
        error = traceback.format_exc()
        logging.getLogger(__name__).error("job failed:\n%s", error)
        return JobFailed(error)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


def run_train_job(
    world_size: int, argv: list[str], *, expect_error: str | None = None, restart_after: bool = False
) -> dict:
    """A trainer job in the pool; writes and returns ``{"ok", "error", "seconds"}`` (``<dump>/job_status.json``).

    ``expect_error``: the job passes when every rank failed with an error containing the text.
    """
    start = time.perf_counter()
    folder = _dump_folder(argv)
    name = f"train {os.path.basename(folder.rstrip('/'))}"
    try:
        results = run_in_pool(train_job, world_size, argv, restart_after=restart_after, name=name)
    except PoolBroken as e:
        status = {"ok": False, "error": str(e)}
    else:
        errors = [None if r is None else r.error for r in results]
        failed = [e for e in errors if e is not None]
        if expect_error is not None:  # the status keeps the error the job was expected to raise
            ok = len(failed) == world_size and all(expect_error in e for e in failed)
            error = failed[0] if ok else f"expected every rank to fail with {expect_error!r}; {len(failed)} failed"
        elif failed:
            ok, error = False, failed[0] + f"\n({len(failed)} of {world_size} ranks failed; see rank*.log)"
        else:
            ok, error = True, None
        status = {"ok": ok, "error": error}
    status["seconds"] = time.perf_counter() - start
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, STATUS_FILE), "w") as f:
        json.dump(status, f)
    return status
