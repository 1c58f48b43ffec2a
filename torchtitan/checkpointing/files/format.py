"""The checkpoint format's version: what a release writes, what it reads, and the upgrade steps between them.

Every ``.complete`` marker records ``format`` (FORMAT_VERSION when it was written) and ``release`` (the
torchtitan version that wrote it). The promise (docs/checkpoint.md, "Compatibility"): this release resumes every
checkpoint of a format <= FORMAT_VERSION bit for bit. tests/runs/checkpoint/test_checkpoint_compat.py holds it to that with the
checkpoints in tests/assets/checkpoints/, written by earlier releases.

A change that writes something an earlier format's checkpoints do not hold (a renamed key, a new state) does one of:

* an upgrade step: bump FORMAT_VERSION and add ``UPGRADES[old] = Upgrade(...)`` that turns a format-``old``
  checkpoint's keys into the new ones at load time (the files are never rewritten); the shipped assets then test
  the step;
* a break: bump FORMAT_VERSION with no step and record the last release that reads the old format in
  READ_BY; loading such a checkpoint is then a one-line refusal naming that release.

Light (no DCP import): the pre-launch checks read markers through it.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1
# Markers before format 1 recorded no version: the same layout (format 1 only added the record).
UNVERSIONED = 0


@dataclass(frozen=True)
class Upgrade:
    """Turns a checkpoint of one format into the next: ``renames`` maps a saved top-level key (``model.x.weight``,
    ``optimizer.state.x.weight.exp_avg``) or a key prefix ending in ``.`` to its name in the next format."""

    renames: dict[str, str] = field(default_factory=dict)
    why: str = ""

    def rename(self, key: str) -> str:
        if key in self.renames:
            return self.renames[key]
        for old, new in self.renames.items():
            if old.endswith(".") and key.startswith(old):
                return new + key[len(old) :]
        return key


# format -> the step from it to format + 1. Format 0 -> 1 renames nothing.
UPGRADES: dict[int, Upgrade] = {UNVERSIONED: Upgrade(why="format 1 only added the version record")}
# format -> the last release that reads it, for formats no upgrade step reaches (none yet).
READ_BY: dict[int, str] = {}


def release() -> str:
    """This installation's torchtitan version (what markers record as ``release``)."""
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def marker_fields() -> dict[str, Any]:
    """What every marker written by this release records about its format."""
    return {"format": FORMAT_VERSION, "release": release()}


def format_of(marker: dict[str, Any] | None) -> int:
    return int((marker or {}).get("format", UNVERSIONED))


def describe(marker: dict[str, Any] | None) -> str:
    """``format 1, written by torchtitan 0.1.0``: for the errors that name a checkpoint."""
    marker = marker or {}
    if "format" not in marker:
        return "unversioned format (written before torchtitan recorded checkpoint formats)"
    return f"format {marker['format']}, written by torchtitan {marker.get('release', 'unknown')}"


def check_readable(marker: dict[str, Any] | None, path: str) -> None:
    """Refuse, in one line, a checkpoint this release cannot read: a newer format, or an older one no upgrade reaches.

    Raises:
        ValueError: naming the format, the release that wrote it and the one that reads it.
    """
    version = format_of(marker)
    here = f"this torchtitan ({release()}) reads formats {UNVERSIONED}-{FORMAT_VERSION}"
    if version > FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} is in a newer format ({describe(marker)}) and {here}; resume it with torchtitan "
            f"{(marker or {}).get('release', 'of that release')} or later (pip install -U torchtitan)"
        )
    steps = upgrade_path(version)
    if steps is None:
        raise ValueError(
            f"checkpoint {path} is in a format this release no longer reads ({describe(marker)}); {here}; resume it "
            f"with torchtitan {READ_BY.get(version, 'of its release')}, or convert it there to a weights-only "
            "export (checkpoint.model_weights_only) to start a new run here"
        )


def upgrade_path(version: int) -> list[Upgrade] | None:
    """The steps from ``version`` to FORMAT_VERSION, or None if one is missing."""
    steps = []
    for v in range(version, FORMAT_VERSION):
        if v not in UPGRADES:
            return None
        steps.append(UPGRADES[v])
    return steps


def upgraded_key(key: str, steps: list[Upgrade]) -> str:
    """``key`` of an older checkpoint after ``steps`` (its ``upgrade_path``), as this release names it."""
    for step in steps:
        key = step.rename(key)
    return key


def upgrade_metadata(metadata: Any, read_marker: Callable[[], dict[str, Any] | None]) -> Any:
    """A DCP ``Metadata`` of an older format with its keys renamed to this release's (in place; returned).
    ``read_marker``: the checkpoint's marker, read only when some upgrade step renames keys (none does today, so a
    load reads no marker here).

    Renaming the keys of ``state_dict_metadata`` and ``storage_data`` is all a key rename needs: the data
    files are addressed by offset, not by name, so the files stay as they were written.
    """
    if not any(step.renames for step in UPGRADES.values()):
        return metadata
    steps = [step for step in upgrade_path(format_of(read_marker())) or [] if step.renames]
    if not steps:
        return metadata
    metadata.state_dict_metadata = {upgraded_key(k, steps): v for k, v in metadata.state_dict_metadata.items()}
    if metadata.storage_data is not None:
        metadata.storage_data = {
            type(index)(upgraded_key(index.fqn, steps), index.offset, index.index): info
            for index, info in metadata.storage_data.items()
        }
    return metadata
