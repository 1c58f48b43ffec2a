"""``python -m torchtitan.launch TORCHRUN_ARGS``: torchrun, with its ranks' failures told once.

Takes exactly torchrun's arguments (``--nproc_per_node``, ``--local-ranks-filter``, ``--tee``,
rendezvous, ...) and runs ``torch.distributed.run.run``. Instead of torchrun's ChildFailedError
traceback, a failed run prints, on the launcher's stderr (which the user sees whatever
``--local-ranks-filter`` hides), the root cause once with the ranks that raised it
(``failures.summarize``), and exits with the ranks' exit code: 2 for a user error, 1 for a crash
(whose traceback is shown once), 128 + N for a rank killed by signal N. A SIGTERM/SIGINT to the
launcher is passed on to the ranks by torchrun; what they then report (a stop, a checkpoint
saved) is printed the same way.

Each node's launcher sees its own ranks only: on several nodes, the node whose rank failed first
prints the root cause; the others print what their ranks saw.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
import tempfile
import time

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from torchtitan.launch.failures import EXIT_USER_ERROR, LAUNCHER_ENV, Failure, read_failure, summarize

# torchelastic's own lines about a failure we report ourselves
_NOISE = ("Sending process %s closing signal", "failed (exitcode: %s)", "Received %s death signal")
_NOISY_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NOISE)


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv``; print the failed ranks' root cause once; return the exit code."""
    args = parse_args(argv)
    if str(args.nproc_per_node).isdigit() and int(args.nproc_per_node) < 1:  # torchrun: an AssertionError
        print(f"error: --nproc_per_node = {args.nproc_per_node}: start at least one process", file=sys.stderr)
        return EXIT_USER_ERROR
    if args.log_dir is None:  # torchrun would pick this temp folder itself; we read the ranks' records there
        args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    os.environ[LAUNCHER_ENV] = "1"  # the ranks inherit it: they leave the printing to us
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).addFilter(_DropNoise())
    start = time.time()
    try:
        run(args)
    except ChildFailedError as e:
        failures = [read_failure(r, pf.error_file, pf.exitcode, pf.timestamp) for r, pf in e.failures.items()]
        return _report(failures, args.log_dir)
    except SignalException as e:
        print(f"launcher: received {e.sigval.name}; passed it on to the ranks", file=sys.stderr)
        failures = _records_since(args.log_dir, start)
        return _report(failures, args.log_dir) if failures else 128 + int(e.sigval)
    except ValueError as e:  # torchrun's own arguments, e.g. --nproc_per_node abc
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


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
