"""A checkpoint folder's completion marker (``.complete``: step, kind, model) and the step folders' names.

Light (json and os only): the pre-launch checks read markers without loading DCP.
"""

from __future__ import annotations

import json
import logging
import os
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
