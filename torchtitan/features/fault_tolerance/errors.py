"""What ends a fault-tolerant run: one line each, never a hang or a torch traceback.

torchft reports most failures by logging a traceback and carrying on (a failed all-reduce marks the step
uncommittable); what it raises comes from its Rust RPC layer with multi-line gRPC details. This module
turns both into one short line for the user and keeps torchft's own loggers quiet (``quiet_torchft``).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Any

from torchtitan.components.run_control import AgreedStop

# Exit code of a run that fault tolerance had to give up on (0 done, 1 bug, 2 user error, 3 stopped by a
# signal, 4 non-finite step: components/run_control.py).
EXIT_REPLICAS = 5

INSTALL_HINT = (
    'fault_tolerance.enable needs torchft, which is not installed; install the optional extra: pip install -e ".[ft]"'
)


class ReplicaGroupsFailed(AgreedStop):
    """Fault tolerance cannot go on (no lighthouse, no quorum, nothing committed for too long): one line."""

    exit_code = EXIT_REPLICAS


def require_torchft() -> Any:
    """The torchft module, its logs quieted; ImportError naming the extra to install if it is missing."""
    # torchft's Rust side logs every quorum and commit at INFO on stderr unless RUST_LOG says otherwise; it
    # reads the variable once, when its logger starts (the first Manager). A user's own setting wins.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    quiet_torchft()
    return torchft


def quiet_torchft() -> None:
    """torchft's Python loggers log tracebacks for failures the trainer reports itself in one line, and
    empty INFO records per quorum and commit (structured-logging hooks): keep only their real problems."""
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # a heal loads tensors from a read-only buffer; torch warns once that it would not be writable
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def short_reason(error: BaseException | None) -> str:
    """The first line of an error torchft recorded or raised, without gRPC's metadata."""
    if error is None:
        return "no error recorded"
    inner = getattr(error, "original_exception", error)  # torchft wraps recorded errors with their traceback
    text = str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)  # gloo's "[.../pair.cc:553] " source location
    for cut in (", details: [", ", metadata: MetadataMap", ". This is typically caused by"):
        text = text.split(cut)[0]
    return text[:300]
