"""The checkpoint folder on disk or in an object store: ``step-N`` folders, completion markers, discovery, purge,
save schedule.

No torch.distributed here: rank 0 calls these and broadcasts what it decided. Files go through storage.py: a local
folder with os/shutil as always, a URL (``s3://...``) through fsspec.

A checkpoint counts only when its ``.complete`` marker exists. The marker is written last, by
rank 0, after DCP reports every rank's data written (DCP's coordinator writes ``.metadata`` only
after gathering all ranks' write results), and atomically (temp file + rename). A folder without
it is a save that was interrupted: ignored on resume, never loaded, purged once a newer save completes.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan.checkpointing.files.integrity import DATA_SUFFIX, SIDECAR_SUFFIX, crc32_of_file, read_sidecar
from torchtitan.checkpointing.files.marker import EXPORT, FULL, MARKER, SEED, read_marker, step_folder
from torchtitan.checkpointing.files.storage import copy_file, files, is_url, makedirs, remove, rmtree, subfolders

logger = logging.getLogger(__name__)

SET_ASIDE = "set-aside"  # abandoned branches and replaced checkpoints, out of discovery
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    marker: dict[str, Any] | None  # None: incomplete

    @property
    def complete(self) -> bool:
        return self.marker is not None

    @property
    def kind(self) -> str | None:
        return None if self.marker is None else self.marker.get("kind", FULL)


def list_files(path: str) -> dict[str, list[int]]:
    """The checkpoint's files -> [size in bytes, CRC32 or -1]; run on rank 0 before the marker.

    Every file's size is recorded (a ``stat``). Every data file's CRC32 comes from the sidecar its
    rank wrote while writing it (integrity.ChecksummingWriter), so nothing is read back here;
    ``.metadata`` (small) is checksummed directly. So a missing, truncated or extended file and any
    altered byte are caught before loading. A data file without a usable sidecar (written by
    another writer, or its size differs from what went through the stream) records -1 with a
    warning: only its size is checked then. The sidecars themselves are not listed.
    """
    found = {}
    for name, size in sorted(files(path).items()):
        if not name.startswith(MARKER) and not name.endswith(SIDECAR_SUFFIX):
            found[name] = [size, _written_crc(os.path.join(path, name), size)]
    return found


def _written_crc(full: str, size: int) -> int:
    if os.path.basename(full) == ".metadata":
        return crc32_of_file(full)
    sidecar = read_sidecar(full)
    if sidecar is None:
        if full.endswith(DATA_SUFFIX):
            logger.warning("checkpoint file %s has no CRC32 sidecar; its marker records only its size", full)
        return -1
    if sidecar[0] != size:
        logger.warning(
            "checkpoint file %s has %d bytes, its writer counted %d; its marker records only its size",
            full,
            size,
            sidecar[0],
        )
        return -1
    return sidecar[1]


def verify_files(c: CheckpointInfo, *, checksums: bool = True) -> None:
    """Compare the folder with what its marker recorded (markers from before this check record nothing).

    Sizes are always compared. With ``checksums`` (checkpoint.verify_checksums) every file with a
    recorded CRC32 is read back in 16 MiB pieces and compared; without, only ``.metadata`` (small)
    is. Older markers record -1 for data files: their size alone is checked.

    Raises:
        ValueError: naming each missing file, size change and checksum mismatch.
    """
    recorded = (c.marker or {}).get("files")
    if not recorded:
        return
    problems = []
    try:
        present = files(c.path)  # one listing (an object store's gives every size)
    except FileNotFoundError:
        present = {}
    for name, (size, crc) in recorded.items():
        full = os.path.join(c.path, name)
        if name not in present:
            problems.append(f"{name} is missing")
        elif present[name] != size:
            problems.append(f"{name} has {present[name]} bytes, the save wrote {size}")
        elif crc != -1 and (checksums or name == ".metadata") and crc32_of_file(full) != crc:
            problems.append(f"{name} does not match its CRC32 (altered after the save)")
    if problems:
        raise ValueError(
            f"checkpoint {c.path} is corrupted: {'; '.join(problems)}; resume from another step "
            "(checkpoint.load_step) or restore the folder"
        )


def list_checkpoints(root: str) -> list[CheckpointInfo]:
    """Every ``step-N`` folder under ``root``, oldest first (none if ``root`` does not exist)."""
    found = []
    for name in subfolders(root):
        if m := _STEP_DIR.match(name):
            path = os.path.join(root, name)
            found.append(CheckpointInfo(int(m.group(1)), path, read_marker(path)))
    return sorted(found, key=lambda c: c.step)


def find_resume_checkpoint(root: str, load_step: int, verify_checksums: bool = True) -> CheckpointInfo | None:
    """The checkpoint to start from: ``load_step``, or with -1 the newest complete full/seed one.

    The one picked is checked against its marker: ``verify_files(..., checksums=verify_checksums)``.

    Raises:
        ValueError: ``load_step`` names a folder that is missing, incomplete or a weights-only export.
    """
    found = list_checkpoints(root)
    if load_step >= 0:
        match = [c for c in found if c.step == load_step]
        if not match:
            raise ValueError(
                f"checkpoint.load_step = {load_step}: {step_folder(root, load_step)} does not exist; "
                f"complete checkpoints: {[c.step for c in found if c.complete]} (or -1 for the newest)"
            )
        _check_loadable(match[0], f"checkpoint.load_step = {load_step}")
        verify_files(match[0], checksums=verify_checksums)
        return match[0]
    resumable = [c for c in found if c.kind in (FULL, SEED)]
    newest = resumable[-1] if resumable else None
    for c in found:
        if newest is None or c.step > newest.step:
            if not c.complete:
                logger.warning(
                    "ignoring incomplete checkpoint %s (no %s marker: its save did not finish)", c.path, MARKER
                )
            elif c.kind == EXPORT:
                logger.info("not resuming from %s: a weights-only export, not a training state", c.path)
    if newest is not None:
        verify_files(newest, checksums=verify_checksums)
    return newest


def resume_point(root: str, *, enabled: bool, load_step: int) -> CheckpointInfo | None:
    """The checkpoint a run with these ``checkpoint`` keys would resume from, found from the markers alone
    (nothing verified or logged: ``find_resume_checkpoint`` does that at the load); None: it starts fresh.

    With ``load_step`` >= 0 the run resumes (or fails to) from that step's folder whenever ``root`` holds any
    checkpoint, so a wrong step is reported next to the checkpoints that are there.
    """
    found = list_checkpoints(root) if enabled else []
    if load_step >= 0 and found:
        return next(
            (c for c in found if c.step == load_step), CheckpointInfo(load_step, step_folder(root, load_step), None)
        )
    resumable = [c for c in found if c.kind in (FULL, SEED)]
    return resumable[-1] if resumable else None


def _check_loadable(c: CheckpointInfo, what: str) -> None:
    if not c.complete:
        raise ValueError(
            f"{what}: {c.path} is incomplete (no {MARKER} marker: its save did not finish); "
            "pick a complete step or -1 for the newest complete one"
        )
    if c.kind == EXPORT:
        raise ValueError(
            f"{what}: {c.path} is a weights-only export (checkpoint.model_weights_only), not a training "
            "state; resume from a full checkpoint, or convert it (scripts/) to start a new run"
        )


def purge_stale(root: str, keep_latest_k: int) -> list[str]:
    """Delete all but the newest ``keep_latest_k`` complete checkpoints; returns the deleted paths.

    Counted: complete full checkpoints (resume points) only. Never deleted: the step-0 seed,
    weights-only exports (the run's output, not resume points: counting them would let a final
    export purge the last full checkpoint at K = 1), anything newer than the newest complete
    checkpoint (a save in flight). Incomplete folders older than it are interrupted saves and are
    deleted too. ``keep_latest_k = 0`` keeps everything.
    """
    if keep_latest_k <= 0:
        return []
    found = list_checkpoints(root)
    counted = [c for c in found if c.complete and c.kind == FULL]
    if len(counted) <= keep_latest_k:
        stale = []
    else:
        stale = counted[:-keep_latest_k]
    newest_complete = max((c.step for c in found if c.complete), default=-1)
    stale += [c for c in found if not c.complete and c.step < newest_complete]
    for c in stale:
        # marker first: a purge interrupted half way leaves an incomplete folder, never a bad "complete" one
        if c.complete:
            remove(os.path.join(c.path, MARKER))
        rmtree(c.path, ignore_errors=True)
        logger.info("purged checkpoint %s (checkpoint.keep_latest_k = %d)", c.path, keep_latest_k)
    return [c.path for c in stale]


def set_aside(root: str, checkpoints: list[CheckpointInfo], why: str) -> list[str]:
    """Move complete checkpoints out of discovery into ``<root>/set-aside/<why>-<time>/``; returns the new paths.

    Kept, not deleted (a user may want them back); no longer a ``step-N`` folder of ``root``, so never
    resumed from, counted by keep_latest_k or purged.
    """
    if not checkpoints:
        return []
    dest = os.path.join(root, SET_ASIDE, f"{why}-{time.strftime('%Y%m%d-%H%M%S')}")
    makedirs(dest, exist_ok=True)
    moved = []
    for c in checkpoints:
        target = os.path.join(dest, os.path.basename(c.path))
        _move(c.path, target)
        moved.append(target)
    logger.warning("moved %s to %s (%s)", ", ".join(os.path.basename(c.path) for c in checkpoints), dest, why)
    return moved


def _move(path: str, target: str) -> None:
    """Move a checkpoint folder: a rename on disk; on an object store, which has none, copy every object (the
    marker last), then delete the marker first: interrupted, it leaves a complete checkpoint at ``path`` or at
    ``target``, never a damaged complete one."""
    if not is_url(path):
        os.replace(path, target)
        return
    names = sorted(files(path), key=lambda n: n == MARKER)
    for name in names:
        copy_file(os.path.join(path, name), os.path.join(target, name))
    if MARKER in names:
        remove(os.path.join(path, MARKER))
    rmtree(path)


def later_branch(root: str, step: int) -> list[CheckpointInfo]:
    """Complete checkpoints newer than ``step``: after resuming from ``step`` they belong to an abandoned run."""
    return [c for c in list_checkpoints(root) if c.complete and c.step > step]


class SaveSchedule:
    """Whether a step is due for a save: every ``interval`` steps, or ``interval`` seconds since the last save.

    With seconds, only rank 0's answer counts (clocks differ per rank); the manager broadcasts it.
    ``clock`` is injectable for tests.
    """

    def __init__(self, interval_type: str, interval: int, clock: Callable[[], float] = time.monotonic):
        if interval_type not in ("steps", "seconds"):
            raise ValueError(f"checkpoint.interval_type = {interval_type!r}: allowed are 'steps', 'seconds'")
        self.interval_type = interval_type
        self.interval = interval
        self.clock = clock
        self.last_save = clock()

    def due(self, step: int) -> bool:
        if self.interval_type == "steps":
            return step % self.interval == 0
        return self.clock() - self.last_save >= self.interval

    def saved(self) -> None:
        self.last_save = self.clock()
