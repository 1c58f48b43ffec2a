"""A checkpoint folder's completion marker (``.complete``: step, kind, format, model) and the step folders' names.

Light (json, os and storage.py, which imports fsspec only for a URL): the pre-launch checks read markers without
loading DCP.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from torchtitan.checkpointing.files.format import marker_fields
from torchtitan.checkpointing.files.storage import exists, is_url, isdir, open_file, subfolders, write_object

logger = logging.getLogger(__name__)

MARKER = ".complete"
EARLIER_RUNS = "earlier_runs"  # where a run sets aside the records of the run before it in its folder

# What a complete checkpoint holds ("kind" in its marker).
FULL = "full"  # model, optimizer, lr scheduler, data loader, train state: a resume point
SEED = "seed"  # step 0, model weights only: the initial weights a run starts from
EXPORT = "export"  # model weights only (checkpoint.model_weights_only), maybe cast: not a resume point


def step_folder(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step}")


def write_marker(path: str, step: int, kind: str, **extra: Any) -> None:
    """Mark ``path`` complete. Atomic: readers see no marker or the whole marker (on an object store: one object,
    written in one request; there is no rename to make it atomic otherwise)."""
    body = {"step": step, "kind": kind, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **marker_fields(), **extra}
    if is_url(path):
        write_object(os.path.join(path, MARKER), json.dumps(body, indent=1).encode())
        return
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MARKER))


def read_marker(path: str) -> dict[str, Any] | None:
    try:
        with open_file(os.path.join(path, MARKER), "rb") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        if is_url(path) and isinstance(e, OSError):  # the store refused or failed (after its retries): no answer
            raise ValueError(
                f"checkpoint {path}: its {MARKER} marker could not be read: {type(e).__name__}: {e}"
            ) from e
        logger.warning("checkpoint %s: unreadable marker (%s); treating it as incomplete", path, e)
        return None


def recorded_tokenizer(path: str, *, fix: str) -> str | None:
    """The tokenizer the run that saved checkpoint ``path`` trained with (its marker's record), or None (no
    marker, or a checkpoint saved before markers recorded it, or a seed).

    Raises:
        FileNotFoundError: the recorded tokenizer is not on this machine (``fix``: how the caller's user passes
            another, the end of the one-line error).
    """
    marker = read_marker(path) or {}
    recorded = (marker.get("data") or {}).get("tokenizer")
    if recorded and not os.path.exists(recorded):
        raise FileNotFoundError(
            f"checkpoint {path} was trained with the tokenizer {recorded}, which does not exist here; {fix}"
        )
    return recorded


def moved_by_a_later_run(path: str) -> str | None:
    """Where ``path``, which does not exist, went if a later run in its dump folder set it aside
    (launch/run_folder.py: an earlier run's records move to ``<dump_folder>/earlier_runs/<when>/``): the newest
    ``<an ancestor>/earlier_runs/<when>/<the rest of path>`` that exists (relative if ``path`` was), or None."""
    parts = Path(os.path.abspath(path)).parts
    for depth in range(1, min(4, len(parts))):  # the dump folder: checkpoint/step-N, hf/step-N, replica_i/...
        ancestor, rest = Path(*parts[:-depth]), Path(*parts[-depth:])
        found = [p for p in ancestor.glob(f"{EARLIER_RUNS}/*/{glob.escape(str(rest))}") if p.exists()]
        if found:
            newest = str(max(found, key=lambda p: p.parents[depth - 1].name))  # <when>: run-<its start, ISO>
            return newest if os.path.isabs(path) else os.path.relpath(newest)
    return None


def does_not_exist(path: str) -> str:
    """ "does not exist", and where it went if a later run moved it: the middle of a one-line error naming it."""
    moved = moved_by_a_later_run(path)
    return f"does not exist (a later run in its dump folder moved it to {moved})" if moved else "does not exist"


def why_not_loadable(path: str) -> str:
    """Why ``path``, which has no marker, is not a complete checkpoint: the end of a one-line error naming it."""
    if not exists(path):
        if not is_url(path) and moved_by_a_later_run(path):
            return f"{does_not_exist(path)}; pass that folder"
        return "does not exist; pass a complete step-N folder of a checkpoint (<dump_folder>/checkpoint/step-N)"
    if not isdir(path):
        return "is a file, not a checkpoint folder; pass a complete step-N folder of a checkpoint"
    steps = sorted(
        (int(m.group(1)), name)
        for name in subfolders(path)
        if (m := re.fullmatch(r"step-(\d+)", name)) and read_marker(os.path.join(path, name)) is not None
    )
    if steps:
        return f"holds checkpoints, it is not one; pass one of its step-N folders (the newest complete: {steps[-1][1]})"
    return (
        f"is not a complete checkpoint (no {MARKER} marker: its save did not finish, or it is not a checkpoint folder)"
    )
