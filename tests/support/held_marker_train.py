"""The trainer with rank 0 holding back one checkpoint's ``.complete`` marker, for the killed-save tests.

``python -m torchtitan.launch ... -m tests.support.held_marker_train STEP SECONDS --job.config_file FILE [--section.key value ...]``
runs ``torchtitan.train.main`` on the rest of the arguments; its checkpointer is the trainer's own
(``engine.builders.build_checkpointer``) with an injected ``before_marker`` that sleeps SECONDS once step STEP's
data is written and before its marker, so a test can SIGKILL the job mid-save. ``popen_held_marker``
launches it on 2 ranks the way run_llama_train.sh launches the trainer. ``kill_mid_save`` runs the same trainer
as a job in a worker pool of its own (tests/support/pool.py) and SIGKILLs its ranks: for a test that reads what the crash
leaves on disk, not what a launcher prints (no launcher and no 2 fresh ranks: 3 torch imports, ~3 s on 2 cores).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# run_llama_train.sh's launch with NGPU=2, LOG_RANK=0 (and no pre-launch check: every rank checks anyway)
LAUNCH = [
    sys.executable,
    "-m",
    "torchtitan.launch",
    "--nproc_per_node=2",
    "--rdzv_backend",
    "c10d",
    "--rdzv_endpoint=localhost:0",
    "--local-ranks-filter",
    "0",
    "--role",
    "rank",
    "--tee",
    "3",
]

logger = logging.getLogger(__name__)


def popen_held_marker(step: int, seconds: float, overrides: list[str], *, stdout: int | IO) -> subprocess.Popen:
    """The trainer on 2 ranks (debug_model.toml plus ``overrides``), step ``step``'s marker held back
    ``seconds``; in a session of its own; ``kill_job`` kills it whole (launcher and ranks), as a crash would."""
    argv = [str(step), str(seconds), "--job.config_file", "./train_configs/debug_model.toml", *overrides]
    return subprocess.Popen(
        [*LAUNCH, "-m", "tests.support.held_marker_train", *argv],
        cwd=ROOT,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux /proc): the launcher's ranks run in sessions of their own."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's session and every rank below it at once (a machine crash), and reap the launcher.

    ``os.killpg`` alone leaves the ranks (torch's launcher starts each in a session of its own) to their parent
    watch, which stops them ~30 s later: the next run on the same folder would wait for them (run_folder.py).
    """
    ranks = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def hold_marker(held_step: int, seconds: float, step: int) -> None:
    """``CheckpointManager``'s ``before_marker``: sleep before step ``held_step``'s marker only."""
    if step == held_step:
        logger.warning("holding back step-%d's marker for %.0f s", step, seconds)
        time.sleep(seconds)


def kill_mid_save(step: int, overrides: list[str], written: Callable[[], bool], timeout_s: float = 300) -> None:
    """The trainer (debug_model.toml plus ``overrides``) on 2 ranks of a worker pool of its own, step ``step``'s
    marker held back; once ``written()`` holds (polled), both ranks are SIGKILLed, as a crash would.

    Raises AssertionError when ``written()`` never held: the job ended, or ``timeout_s`` passed (the tails of
    the ranks' output in the message)."""
    from tests.support.pool import WorkerPool, train_job
    from torchtitan.engine.builders import Builders, build_checkpointer

    before_marker = functools.partial(hold_marker, step, 600.0)  # held until the kill
    builders = Builders(checkpointer=functools.partial(build_checkpointer, before_marker=before_marker))
    argv = ["--job.config_file", "./train_configs/debug_model.toml", *overrides]
    pool = WorkerPool(2)
    threads = ThreadPoolExecutor(1)
    try:
        job = threads.submit(pool.run, train_job, argv, builders, name="train held marker, killed")
        deadline = time.monotonic() + timeout_s
        while not written() and not job.done() and time.monotonic() < deadline:
            time.sleep(0.1)
        seen = written()
        pool.kill()
        if not seen:
            tails = []
            for path in pool.out_paths:
                with contextlib.suppress(OSError), open(path, errors="replace") as f:
                    tails.append("".join(f.readlines()[-20:]))
            raise AssertionError("the save to kill never came:\n" + "\n".join(tails))
        with contextlib.suppress(Exception):  # the killed pool: PoolBroken, as expected
            job.result(timeout=60)
    finally:
        pool.kill()
        threads.shutdown(wait=False)


def main(argv: list[str]) -> int:
    from torchtitan.engine.builders import Builders, build_checkpointer
    from torchtitan.train import main as train_main

    before_marker = functools.partial(hold_marker, int(argv[0]), float(argv[1]))
    builders = Builders(checkpointer=functools.partial(build_checkpointer, before_marker=before_marker))
    return train_main(argv[2:], builders=builders)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
