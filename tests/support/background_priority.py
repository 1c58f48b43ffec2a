"""Lowest CPU priority for the test session's background work (the estimator's file: tests/runs/estimation/test_estimation.py).

``os.nice(19)`` alone does not yield the cores on Linux with autogroup scheduling
(``/proc/sys/kernel/sched_autogroup_enabled`` = 1, the default of most distributions' kernels): the scheduler
first shares the CPU between *sessions* equally, and nice only orders the processes inside one session. The
tests' launches (``run_llama_train.sh``: torchrun starts every rank in a session of its own) then got a third of
a core less each while the background ran, measured: a 2-rank launch that takes 5-6 s alone took 10-20 s.

So a background process starts a session of its own and gives that session nice 19 as well
(``/proc/self/autogroup``; raising it needs no privilege). Without autogroup the file is absent and plain nice
does the job. Run as a script, it does the same for a rank of a torchrun launch and then runs a module:
``python -m torch.distributed.run ... tests/support/background_priority.py MODULE ARGS...``.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys


def lower_priority() -> None:
    """This process at the lowest priority, against the processes of every other session too."""
    with contextlib.suppress(OSError):  # already a session leader (a torchrun rank): its own session is new
        os.setsid()
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as f:
        f.write("19")
    os.nice(19 - os.nice(0))


if __name__ == "__main__":
    lower_priority()
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
