"""The trainer with rank 0 holding back one checkpoint's ``.complete`` marker, for the killed-save tests.

``python -m torchtitan.launch ... -m tests.held_marker_train STEP SECONDS --job.config_file FILE [--section.key value ...]``
runs ``torchtitan.train.main`` on the rest of the arguments; its checkpointer is the trainer's own
(``engine.builders.build_checkpointer``) with an injected ``before_marker`` that sleeps SECONDS once step STEP's
data is written and before its marker, so a test can SIGKILL the job mid-save. ``popen_held_marker``
launches it on 2 ranks the way run_llama_train.sh launches the trainer.
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
from typing import IO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
        [*LAUNCH, "-m", "tests.held_marker_train", *argv],
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


def main(argv: list[str]) -> int:
    from torchtitan.engine.builders import Builders, build_checkpointer
    from torchtitan.train import main as train_main

    before_marker = functools.partial(hold_marker, int(argv[0]), float(argv[1]))
    builders = Builders(checkpointer=functools.partial(build_checkpointer, before_marker=before_marker))
    return train_main(argv[2:], builders=builders)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
