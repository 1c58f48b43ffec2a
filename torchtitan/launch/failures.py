"""Why a rank failed, told once: classified and recorded by the rank, printed by the launcher.

The rank (``report_exception`` / ``report_failure``, called by ``torchtitan.train.main``): a user
error (the trainer's USER_ERRORS, or a storage error: disk full, read-only, no permission, a path
through a file; ``storage_error``) is one line and exit code 2; anything else is a bug ("crash",
exit code 1) and keeps its traceback. The record goes to torchelastic's per-rank error file
(``TORCHELASTIC_ERROR_FILE``, in the JSON layout torchelastic reads, plus a ``torchtitan`` entry).

Under our launcher (``python -m torchtitan.launch``, which sets ``TORCHTITAN_LAUNCHER=1``) the rank
prints nothing: the launcher reads every failed rank's record (``read_failure``) and prints the
root cause once, with the ranks that raised it (``summarize``)::

    error (rank 1): data file 'corpus.jsonl', line 44: 'text' is null; ...
    error (ranks 0,1): No space left on device: 'outputs/metrics.jsonl'; free some space or ...

Without it (one process, or plain torchrun) rank 0 prints ``error: ...`` and a crash prints its
traceback on every rank, as Python would.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

LAUNCHER_ENV = "TORCHTITAN_LAUNCHER"  # set by our launcher: it prints the ranks' failures
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torchelastic for each rank
TRACEBACK_ENV = "TORCHTITAN_TRACEBACK"  # also print the traceback of a user error

EXIT_CRASH = 1
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 128 + 2  # SIGINT, as a shell reports it
# A node of a multi-node run was lost (launch/node_watch.py); 3-5: components/run_control.py, fault_tolerance.
EXIT_NODE_LOST = 7
LOST_PEER = "lost peer"  # the label of a rank whose collective (or store) lost its peer

# What a collective (gloo, NCCL) or the c10d store says when the process at the other end is gone.
_PEER_GONE = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Failed to recv, got 0 bytes",
    "remote process exited",
)


# errno -> what to tell the user to do (the OS's own text names the problem)
_STORAGE_ERRNOS = {
    errno.ENOSPC: "free some space or choose another folder",
    errno.EDQUOT: "free some space or choose another folder",
    errno.EROFS: "the file system is read-only; choose another folder",
    errno.EACCES: "fix its permissions or choose another path",
    errno.EPERM: "fix its permissions or choose another path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; choose another path",
}


@dataclass(frozen=True)
class Failure:
    """One failed rank, as the launcher sees it."""

    rank: int
    label: str  # "error" (a user error), "crash" (a bug), or what the rank said (e.g. "stopped")
    message: str  # one line
    exit_code: int
    time: float  # when the rank recorded it (or when the launcher saw it exit)
    details: str = ""  # a crash's traceback
    recorded: bool = True  # False: the rank left no record (killed by a signal, or died in C code)


# --------------------------------------------------------------------------- the rank's side


def classify(e: BaseException, user_errors: tuple[type[BaseException], ...]) -> tuple[str, str, int]:
    """(label, one-line message, exit code) of an exception that ends a rank."""
    if isinstance(e, KeyboardInterrupt):  # SIGINT before the trainer's own stop handler is installed
        return "stopped", "interrupted by SIGINT before the trainer could stop cleanly; nothing saved", EXIT_INTERRUPTED
    storage = storage_error(e)
    if storage is not None:
        return "error", storage, EXIT_USER_ERROR
    if isinstance(e, RuntimeError) and any(p in str(e) for p in _PEER_GONE):  # DistError is a RuntimeError
        return LOST_PEER, f"a collective lost its peer: {short_line(e)}", EXIT_NODE_LOST
    if isinstance(e, user_errors):
        return "error", str(e), EXIT_USER_ERROR
    return "crash", f"{type(e).__name__}: {e}", EXIT_CRASH


def short_line(e: BaseException) -> str:
    """The first line of ``e``'s message, without gloo's source location or its advice."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:  # "[/.../gloo/transport/tcp/pair.cc:537] Read error ..."
        text = text.split("] ", 1)[1]
    return text.split(". This is typically caused by")[0][:300]


def storage_error(e: BaseException) -> str | None:
    """One line for a disk-full / read-only / permission / not-a-folder error anywhere in ``e``, else None.

    Looks through the exception's causes and, for a DCP ``CheckpointException``, every rank's
    failure (there a full disk may also surface as a short write: "unexpected pos").
    """
    causes = _causes(e)
    for exc, in_checkpoint in causes:
        if isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS:
            where = f": '{exc.filename}'" if exc.filename else " while writing a checkpoint" if in_checkpoint else ""
            return f"{exc.strerror or os.strerror(exc.errno)}{where}; {_STORAGE_ERRNOS[exc.errno]}"
    for exc, _ in causes:
        if isinstance(exc, RuntimeError) and "unexpected pos" in str(exc):
            return (
                "a file write was cut short (torch's writer: 'unexpected pos'), most likely a full disk; "
                "free some space or choose another folder"
            )
    return None


def _causes(e: BaseException) -> list[tuple[BaseException, bool]]:
    """``e``, its ``__cause__``/``__context__`` chain and a CheckpointException's per-rank failures,
    each with whether it came from inside a checkpoint save/load."""
    seen: list[tuple[BaseException, bool]] = []
    todo = [(e, False)]
    while todo:
        exc, in_checkpoint = todo.pop(0)
        if not isinstance(exc, BaseException) or any(exc is s for s, _ in seen):
            continue
        seen.append((exc, in_checkpoint))
        todo += [(exc.__cause__, in_checkpoint), (exc.__context__, in_checkpoint)]
        failures = getattr(exc, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            todo += [(f[0] if isinstance(f, tuple) else f, True) for f in failures.values()]
    return seen


def report_exception(e: BaseException, rank: int, user_errors: tuple[type[BaseException], ...]) -> int:
    """Record (and, without our launcher, print) the exception being handled; returns the exit code."""
    label, message, exit_code = classify(e, user_errors)
    details = traceback.format_exc()
    if label != "crash" and os.environ.get(TRACEBACK_ENV):
        print(details, file=sys.stderr, end="")
    return report_failure(rank, label, message, exit_code, details=details if label == "crash" else "")


def report_failure(rank: int, label: str, message: str, exit_code: int, *, details: str = "") -> int:
    """Record why this rank ends (``label``: "error", "crash", "stopped", ...); returns ``exit_code``."""
    error_file = os.environ.get(ERROR_FILE_ENV)
    if error_file:
        _write_record(error_file, Failure(rank, label, message, exit_code, time.time(), details))
    if error_file and os.environ.get(LAUNCHER_ENV) == "1":
        return exit_code  # the launcher prints it, once for all ranks
    if label == "crash":
        print(details, file=sys.stderr, end="")
    elif rank == 0:
        print(f"{label}: {message}", file=sys.stderr)
    return exit_code


def _write_record(path: str, f: Failure) -> None:
    # torchelastic's own layout (it shows "message" in its summary), plus ours
    record = {
        "message": {
            "message": f"{f.label}: {f.message}",
            "extraInfo": {"py_callstack": f.details or f"{f.label}: {f.message}", "timestamp": str(int(f.time))},
        },
        "torchtitan": {
            "rank": f.rank,
            "label": f.label,
            "message": f.message,
            "exit_code": f.exit_code,
            "time": f.time,
            "details": f.details,
        },
    }
    try:
        with open(path, "w") as fp:
            json.dump(record, fp)
    except OSError as e:  # the rank is failing already; say so rather than hide the original error
        print(f"could not write the error record {path}: {e}", file=sys.stderr)


# --------------------------------------------------------------------------- the launcher's side


def read_failure(rank: int, error_file: str | None, exit_code: int, seen_at: float) -> Failure:
    """The record a failed rank left in ``error_file``, else a line made from its exit code."""
    try:
        with open(error_file or "") as fp:
            ours = json.load(fp)["torchtitan"]
        return Failure(
            int(ours.get("rank", rank)),
            ours["label"],
            ours["message"],
            int(ours["exit_code"]),
            float(ours["time"]),
            ours["details"],
        )
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if exit_code < 0:
        name = _signal_name(-exit_code)
        return Failure(rank, "error", f"killed by {name}", 128 - exit_code, seen_at, recorded=False)
    return Failure(rank, "error", f"exited with code {exit_code} without a message", exit_code, seen_at, recorded=False)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def summarize(failures: list[Failure], logs: str = "") -> tuple[list[str], int]:
    """What the launcher prints for these failed ranks, and its exit code.

    The root cause is the earliest record. A bug shows its traceback once, with the ranks that
    raised it; ranks that failed after a user error (a peer closing a connection) are left out,
    and ranks that left no record are shown only when none did. ``logs`` (where each rank's
    output is) follows a crash or a rank that left no record.
    """
    if not failures:
        return [], 0
    recorded = [f for f in failures if f.recorded]
    if all(f.label == LOST_PEER for f in recorded) and len(recorded) < len(failures):
        recorded = []  # the ranks that are gone (killed, no record) are the cause, not those that lost them
    if recorded:
        root = min(recorded, key=lambda f: f.time)
        shown = [f for f in recorded if f.label == root.label and (root.label != "crash" or f.message == root.message)]
    else:  # ranks that torchelastic stopped after the first failure say SIGTERM: show the first one
        first = [f for f in failures if f.exit_code != 128 + signal.SIGTERM] or failures
        root = min(first, key=lambda f: (f.time, f.rank))
        shown = [f for f in first if f.message == root.message]
    lines = []
    for message, group in _group(shown):
        ranks = sorted(f.rank for f in group)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"
        lines.append(f"{group[0].label} ({who}): {message}")
        if group[0].details:
            lines.append(group[0].details.rstrip("\n"))
    if logs and (root.label == "crash" or not root.recorded):
        lines.append(logs)
    return lines, root.exit_code


def _group(failures: list[Failure]) -> list[tuple[str, list[Failure]]]:
    """Identical messages together, in the order they were first seen."""
    groups: dict[str, list[Failure]] = {}
    for f in sorted(failures, key=lambda f: f.time):
        groups.setdefault(f.message, []).append(f)
    return list(groups.items())


def exit_without_finalization(main: Callable[[], int | None]) -> NoReturn:
    """Run a rank's entry point, then leave with its exit code without interpreter finalization.

    A finished run has closed its files and destroyed its process groups, but gloo's worker threads can still
    hold finished works whose tensors need the GIL to be freed; during finalization that aborts the process now
    and then ("terminate called without an active exception", SIGABRT; pytorch/pytorch#179291, unfixed), and a
    complete run exits as a crash: the launcher restarts it or reports a failure. Streams and logging handlers
    are flushed first; nothing else in the trainer relies on ``atexit``.
    """
    try:
        code = main()
    except SystemExit as e:  # sys.exit inside: keep its meaning
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
