"""A stand-in rank for the launcher tests: ``python -m torchtitan.launch ... -m tests.support.failing_worker MODE``.

It fails the way a trainer rank does (``torchtitan.launch.failures.report_exception``, as
``torchtitan.train.main`` calls it) without importing torch, so a 2-rank launch costs only the
launcher's own start-up. MODE:
  user_error  rank 1 raises a user error; rank 0 then fails as a peer would ("Connection closed by peer")
  crash       rank 1 raises a bug (RuntimeError); rank 0 waits to be stopped
"""

from __future__ import annotations

import os
import sys
import time

from torchtitan.launch.failures import report_exception

USER_ERRORS = (ValueError, NotImplementedError, FileNotFoundError)  # as torchtitan.train


def _fail(mode: str, rank: int) -> None:
    if rank == 1:
        if mode == "user_error":
            raise ValueError("data file 'corpus.jsonl', line 44: 'text' is null; fix or remove that row")
        raise RuntimeError("boom")
    time.sleep(0.3 if mode == "user_error" else 60)
    raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")


def main(mode: str) -> int:
    rank = int(os.environ["RANK"])
    try:
        _fail(mode, rank)
    except Exception as e:  # noqa: BLE001 - as the trainer's main
        return report_exception(e, rank, USER_ERRORS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
