"""``python -m torchtitan.launch TORCHRUN_ARGS``: torchrun, with its ranks' failures told once.

Takes exactly torchrun's arguments (``--nproc_per_node``, ``--local-ranks-filter``, ``--tee``,
rendezvous, ...) and runs ``torch.distributed.run.run``. ``before_ranks`` (``python -m
torchtitan.preflight_launch``'s pre-launch check) runs on the parsed arguments first: a non-zero
code ends the launch before any rank starts. Instead of torchrun's ChildFailedError
traceback, a failed run prints, on the launcher's stderr (which the user sees whatever
``--local-ranks-filter`` hides), the root cause once with the ranks that raised it
(``failures.summarize``), and exits with the ranks' exit code: 2 for a user error, 1 for a crash
(whose traceback is shown once), 128 + N for a rank killed by signal N. A SIGTERM/SIGINT to the
launcher is passed on to the ranks by torchrun; what they then report (a stop, a checkpoint
saved) is printed the same way. Once the ranks are gone, a further signal (a second Ctrl-C) is
ignored: the summary line and exit code, no torchelastic traceback.

Each node's launcher sees its own ranks only: on several nodes, the node whose rank failed first
prints the root cause; the others print what their ranks saw. A node that dies (SIGKILL, power,
network) is told by every surviving launcher in one line naming it and the checkpoint to resume
from, exit code 7 (``node_watch.py``).
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import sys
import tempfile
import time
from argparse import Namespace
from collections.abc import Callable

from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.run import parse_args, run

from torchtitan.launch.failures import (
    EXIT_NODE_LOST,
    EXIT_USER_ERROR,
    LAUNCHER_ENV,
    LOST_PEER,
    Failure,
    read_failure,
    short_line,
    summarize,
)
from torchtitan.launch.node_watch import (
    BEAT_S,
    LOST_AFTER_S,
    LostNode,
    NodeWatch,
    lost_node_line,
    resume_hint,
    watch_applies,
)

# torchelastic's own lines about a failure we report ourselves
_NOISE = (
    "Sending process %s closing signal",
    "failed (exitcode: %s)",
    "Received %s death signal",
    "has failed to shutdown the rendezvous",  # the store's node is gone: told in one line
)
_NOISY_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
    "torch.distributed.elastic.multiprocessing.tail_log",
)
# The signals torchelastic turns into a SignalException in the launcher (its TORCHELASTIC_SIGNALS_TO_HANDLE default).
_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        # A second Ctrl-C while torchelastic waits for the ranks' output to drain: it logs the SignalException's
        # traceback as "error in log tailer"; the stop it asks for is under way already.
        second_signal = record.exc_info is not None and isinstance(record.exc_info[1], SignalException)
        return not second_signal and not any(noise in str(record.msg) for noise in _NOISE)


def main(argv: list[str], before_ranks: Callable[[Namespace], int] | None = None) -> int:
    """Run torchrun with ``argv``; print the failed ranks' root cause once; return the exit code."""
    args = parse_args(argv)
    if str(args.nproc_per_node).isdigit() and int(args.nproc_per_node) < 1:  # torchrun: an AssertionError
        print(f"error: --nproc_per_node = {args.nproc_per_node}: start at least one process", file=sys.stderr)
        return EXIT_USER_ERROR
    if before_ranks is not None and (code := before_ranks(args)) != 0:
        return code
    if args.log_dir is None:  # torchrun would pick this temp folder itself; we read the ranks' records there
        args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    os.environ[LAUNCHER_ENV] = "1"  # the ranks inherit it: they leave the printing to us
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).addFilter(_DropNoise())
    start = time.time()
    watch = NodeWatch(args.rdzv_endpoint, args.rdzv_id, int(args.nnodes)).start() if watch_applies(args) else None
    how = "failed"
    try:
        _run_then_ignore_signals(args)
        how = "done"
    except ChildFailedError as e:
        failures = [read_failure(r, pf.error_file, pf.exitcode, pf.timestamp) for r, pf in e.failures.items()]
        lost = _lost_node(watch, failures)
        return _report_lost(lost, args) if lost is not None else _report(failures, args.log_dir)
    except (RendezvousError, DistError) as e:  # the rendezvous store's node is gone (or unreachable)
        lost = watch.verdict(wait_s=2 * BEAT_S) if watch is not None else None
        if lost is not None:
            return _report_lost(lost, args)
        print(f"error: lost the rendezvous at {args.rdzv_endpoint}: {short_line(e)}", file=sys.stderr)
        return EXIT_NODE_LOST
    except SignalException as e:
        print(f"launcher: received {e.sigval.name}; passed it on to the ranks", file=sys.stderr)
        failures = _records_since(args.log_dir, start)
        return _report(failures, args.log_dir) if failures else 128 + int(e.sigval)
    except ValueError as e:  # torchrun's own arguments, e.g. --nproc_per_node abc
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    finally:
        if watch is not None:
            watch.stop(how)
    return 0


def _run_then_ignore_signals(args: Namespace) -> None:
    """torchrun's ``run``; once it has returned or raised, its ranks are gone and a further stop signal is ignored.

    torchelastic's handler raises a SignalException at every SIGINT/SIGTERM: one that arrives after the ranks
    have stopped (a second Ctrl-C, or a terminal's Ctrl-C and its repeat) would interrupt the launcher's report
    with a traceback, or, at interpreter exit, kill it. There is nothing left to pass it on to: the launcher
    tells what the ranks did, in one line, and exits with their code.
    """
    try:
        run(args)
    finally:
        for name in _STOP_SIGNALS:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_IGN)


def _lost_node(watch: NodeWatch | None, failures: list[Failure]) -> LostNode | None:
    """A lost node, when the ranks failed on a peer that is gone (or were killed by the watch)."""
    if watch is None:
        return None
    if watch.lost is not None:
        return watch.lost
    if all(f.label == LOST_PEER or not f.recorded for f in failures):  # wait for the watch to decide
        return watch.verdict(wait_s=LOST_AFTER_S + 2 * BEAT_S)
    return None


def _report_lost(lost: LostNode, args) -> int:
    resume = resume_hint(args.training_script if args.module else None, list(args.training_script_args))
    print(lost_node_line(lost, endpoint=args.rdzv_endpoint, resume=resume), file=sys.stderr, flush=True)
    return EXIT_NODE_LOST


def _report(failures: list[Failure], log_dir: str) -> int:
    lines, exit_code = summarize(failures, logs=f"each rank's full output: {log_dir}/*/attempt_*/<local rank>/")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return exit_code


def _records_since(log_dir: str, start: float) -> list[Failure]:
    """The records ranks wrote under ``log_dir`` since ``start`` (torchelastic's layout:
    ``<log_dir>/<run>/attempt_<n>/<local rank>/error.json``)."""
    out = []
    for path in glob.glob(os.path.join(log_dir, "*", "attempt_*", "*", "error.json")):
        if os.path.getmtime(path) >= start:
            failure = read_failure(-1, path, 0, start)  # the record names its rank
            if failure.recorded:
                out.append(failure)
    return out
