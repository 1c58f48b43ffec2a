"""A rank stops when its launcher dies, so an orphaned run does not train on, writing the folder.

torchelastic starts each rank in a session of its own, so killing the launcher (or its process
group: ``kill -9 -- -PGID``, an OOM kill) leaves the ranks running without anyone to stop them.
Under torchelastic (``TORCHELASTIC_RUN_ID`` set), ``watch_parent`` starts a daemon thread that
polls ``os.getppid()`` every second; once the parent is gone the rank is told as its launcher
would tell it: SIGTERM (with the trainer's stop handler installed, the step in flight finishes
and a checkpoint is saved; before that, SIGTERM ends the process at once). A rank that has not
exited ``GRACE_SECONDS`` later (for example blocked in a collective whose peer is gone) exits
hard. A process started without a launcher is not watched: ``nohup python -m torchtitan.train``
outlives its shell on purpose.

A thread rather than Linux's ``prctl(PR_SET_PDEATHSIG)``: that signal fires when the *thread*
that started the process exits, not the launcher, and it is Linux-only.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from torchtitan.launch.failures import LAUNCHER_ENV

POLL_SECONDS = 1.0
# As long as torchrun waits for its ranks after passing on a SIGTERM (its --shutdown-timeout default).
GRACE_SECONDS = 30.0
EXIT_ORPHANED = 128 + signal.SIGTERM


def under_launcher() -> bool:
    """Whether torchelastic started this process (its parent is then the launcher)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def watch_parent(poll_seconds: float = POLL_SECONDS, grace_seconds: float = GRACE_SECONDS) -> bool:
    """Under torchelastic, stop this process within ~``poll_seconds`` of its launcher's death; True if watching."""
    if not under_launcher():
        return False
    parent = os.getppid()
    thread = threading.Thread(
        target=_watch, args=(parent, poll_seconds, grace_seconds), name="torchtitan-parent-watch", daemon=True
    )
    thread.start()
    return True


def _watch(parent: int, poll_seconds: float, grace_seconds: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_seconds)
    print(
        f"the launcher (pid {parent}) is gone: stopping this rank (pid {os.getpid()}) as if it had sent SIGTERM",
        file=sys.stderr,
        flush=True,
    )
    os.environ.pop(LAUNCHER_ENV, None)  # nobody will print this rank's last words: it prints them itself
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_seconds)
    print(f"still running {grace_seconds:.0f} s after the launcher died: exiting now", file=sys.stderr, flush=True)
    os._exit(EXIT_ORPHANED)
