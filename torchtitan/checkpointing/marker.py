"""A checkpoint folder's completion marker (``.complete``: step, kind, model) and the step folders' names.

Light (json and os only): the pre-launch checks read markers without loading DCP.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any

logger = logging.getLogger(__name__)

MARKER = ".complete"

# What a complete checkpoint holds ("kind" in its marker).
FULL = "full"  # model, optimizer, lr scheduler, data loader, train state: a resume point
SEED = "seed"  # step 0, model weights only: the initial weights a run starts from
EXPORT = "export"  # model weights only (checkpoint.model_weights_only), maybe cast: not a resume point


def step_folder(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step}")


def write_marker(path: str, step: int, kind: str, **extra: Any) -> None:
    """Mark ``path`` complete. Atomic: readers see no marker or the whole marker."""
    body = {"step": step, "kind": kind, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MARKER))


def read_marker(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        logger.warning("checkpoint %s: unreadable marker (%s); treating it as incomplete", path, e)
        return None


def why_not_loadable(path: str) -> str:
    """Why ``path``, which has no marker, is not a complete checkpoint: the end of a one-line error naming it."""
    if not os.path.exists(path):
        return "does not exist; pass a complete step-N folder of a checkpoint (<dump_folder>/checkpoint/step-N)"
    if not os.path.isdir(path):
        return "is a file, not a checkpoint folder; pass a complete step-N folder of a checkpoint"
    steps = sorted(
        (int(m.group(1)), name)
        for name in os.listdir(path)
        if (m := re.fullmatch(r"step-(\d+)", name)) and read_marker(os.path.join(path, name)) is not None
    )
    if steps:
        return f"holds checkpoints, it is not one; pass one of its step-N folders (the newest complete: {steps[-1][1]})"
    return (
        f"is not a complete checkpoint (no {MARKER} marker: its save did not finish, or it is not a checkpoint folder)"
    )
