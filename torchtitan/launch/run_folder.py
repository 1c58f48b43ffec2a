"""The dump folder a run owns: one live run per folder; what may stop a run from writing there.

``RunLock``: rank 0 creates ``<dump_folder>/run.lock`` (``O_CREAT | O_EXCL``, so exactly one of
two racing runs gets it) holding its host and pid (and its launcher's), before the run writes
anything there, and removes it at exit. A second run on the folder is refused, naming the holder.
A lock left by a run that died without removing it (SIGKILL, a power cut) is stale when its pid is
gone on this host (or now belongs to a younger process); it is taken over with a warning. A holder
whose launcher is gone is an orphan that stops by itself (parent_watch.py): it is waited for. A
lock from another host cannot be checked from here: the error says which file to delete if that
run is gone.

``folder_problem``: why the folder could not be created or written (a path through a file, a
read-only file system, no permission), found without writing: the pre-launch check.

``run_folder``: the folder a run's own files go to: the dump folder, or a fault-tolerant replica group's
``<dump_folder>/replica_<id>/`` (the groups of one job share the dump folder's checkpoints: ``checkpoint_root``).

``set_aside_earlier_run``: one run per folder. A run that does not resume from the folder's checkpoint
finds the records of the run before it (metrics, checkpoints, config.toml, ...) moved into
``<folder>/earlier_runs/<when that run started>/``, said in one log line, so two runs never mix and
none is lost; a resume appends to its own records.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torchtitan.checkpointing.files.marker import EARLIER_RUNS
from torchtitan.checkpointing.files.storage import under
from torchtitan.config.errors import ConfigError
from torchtitan.launch.parent_watch import GRACE_SECONDS, POLL_SECONDS, under_launcher

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


def _section_subfolder(config: JobConfig, which: str) -> str | None:
    """The subfolder a config section asks for (its ``run_subfolder()`` / ``checkpoint_subfolder()`` method: a
    fault-tolerant replica group's own), or None."""
    asked = [sub for f in dataclasses.fields(config) if (sub := _asks(getattr(config, f.name), which))]
    assert len(asked) <= 1, f"two config sections ask for a {which}: {asked}"
    return asked[0] if asked else None


def _asks(section: object, which: str) -> str | None:
    method = getattr(type(section), which, None)
    return method(section) if method is not None else None


def run_folder(config: JobConfig) -> str:
    """Where this launch's own files go (lock, metrics, config.toml, traces): the dump folder, or the subfolder a
    section asks for (fault tolerance: its replica group's); checkpoints stay in the dump folder, shared."""
    sub = _section_subfolder(config, "run_subfolder")
    return os.path.join(config.job.dump_folder, sub) if sub else config.job.dump_folder


def checkpoint_root(config: JobConfig) -> str:
    """The checkpoint folder, or the subfolder of it a section asks for (fault tolerance's semi-synchronous
    modes: each replica group keeps its own). A URL checkpoint.folder is the folder itself, not in the dump
    folder."""
    root = under(config.job.dump_folder, config.checkpoint.folder)
    sub = _section_subfolder(config, "checkpoint_subfolder")
    return os.path.join(root, sub) if sub else root


class FolderInUseError(ValueError):
    """Another live run holds the dump folder's lock."""


def folder_problem(folder: str) -> str | None:
    """Why ``folder`` could not be created or written, found without writing anything; None if none."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"'{existing}' is a file, not a folder; choose another path"
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"'{existing}' is on a read-only file system; choose another folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"'{existing}' is not writable by this user; fix its permissions or choose another folder"
    return None


# What every launch writes first: alone (a start that failed before logging a step), they are replaced.
LAUNCH_RECORDS = ("config.toml", "command.txt", "run_info.json")


def set_aside_earlier_run(folder: str, names: Sequence[str]) -> str | None:
    """Move the earlier run's records (those of ``names`` that ``folder`` holds) into
    ``<folder>/earlier_runs/<its start>/``; returns that folder, or None when there was nothing to keep.

    ``names`` are single path components inside ``folder`` (anything else is skipped: the folder may be a
    home directory, and only what a run writes is ever moved); a symbolic link is the user's (a checkpoint
    folder on another disk, a log sent elsewhere) and stays. A run that left only ``LAUNCH_RECORDS`` (it
    logged no step and saved nothing) keeps nothing worth a folder: its records are overwritten.
    """
    present = [n for n in dict.fromkeys(names) if _own_name(n) and _written(os.path.join(folder, n))]
    if not any(n not in LAUNCH_RECORDS and not _empty(os.path.join(folder, n)) for n in present):
        return None
    started = _started(folder, present)
    name = "run-" + re.sub(r"[^0-9A-Za-z_-]", "-", started)
    dest, i = os.path.join(folder, EARLIER_RUNS, name), 1
    while os.path.lexists(dest):  # an earlier run of the same second: a folder of its own
        i += 1
        dest = os.path.join(folder, EARLIER_RUNS, f"{name}-{i}")
    os.makedirs(dest)
    for record in present:
        os.replace(os.path.join(folder, record), os.path.join(dest, record))
    logger.warning(
        "job.dump_folder %s holds an earlier run (started %s), which this run does not resume: moved its %s into %s",
        folder,
        started,
        ", ".join(present),
        dest,
    )
    return dest


def _own_name(name: str) -> bool:
    return bool(name) and name not in (".", "..", EARLIER_RUNS, LOCK_FILE) and os.path.basename(name) == name


def _written(path: str) -> bool:
    """A file or folder a run wrote (not a link someone made)."""
    return not os.path.islink(path) and (os.path.isfile(path) or os.path.isdir(path))


def _empty(path: str) -> bool:
    return not os.listdir(path) if os.path.isdir(path) else os.path.getsize(path) == 0


def _started(folder: str, present: list[str]) -> str:
    """When the earlier run started: its run_info.json's time, else its oldest record's."""
    try:
        with open(os.path.join(folder, "run_info.json"), encoding="utf-8") as f:
            return str(json.load(f)["started"])[:19]
    except (OSError, ValueError, KeyError, TypeError):
        oldest = min(os.lstat(os.path.join(folder, n)).st_mtime for n in present)
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(oldest))


def _proc_stat(pid: int) -> list[str]:
    """Fields 3.. of /proc/<pid>/stat (Linux): [0] the state, [19] the start time in ticks since boot."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return []


def _process_start(pid: int) -> str | None:
    """The process's start time (Linux), to tell a reused pid apart."""
    fields = _proc_stat(pid)
    return fields[19] if len(fields) > 19 else None


def _alive(holder: dict) -> bool:
    """Whether the process ``holder`` describes (host, pid, pid_start) still runs (decidable on its host only)."""
    if holder.get("host") != socket.gethostname():
        return True  # cannot tell from here
    pid = int(holder.get("pid") or -1)
    if pid == os.getpid():
        return False  # a dead run's pid, reused by us (a restarted container)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    fields = _proc_stat(pid)
    if fields[:1] == ["Z"]:
        return False  # exited, not yet reaped
    start = holder.get("pid_start")
    return start is None or _process_start(pid) in (None, start)


def _orphaned(holder: dict) -> bool:
    """Whether the holder ran under a launcher that is gone (then it stops within GRACE_SECONDS)."""
    launcher = holder.get("launcher")
    return bool(launcher) and not _alive({"host": holder.get("host"), **launcher})


class RunLock:
    """``<folder>/run.lock`` while this process runs there (also as ``with RunLock(folder):``).

    Raises:
        FolderInUseError: from ``acquire``, when a live run holds the lock.
    """

    def __init__(self, folder: str):
        self.folder = folder
        self.path = os.path.join(folder, LOCK_FILE)
        self.me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "launcher": {"pid": os.getppid(), "pid_start": _process_start(os.getppid())} if under_launcher() else None,
        }
        self.held = False

    def acquire(self) -> None:
        for _ in range(3):  # a stale lock is removed, then we race for a fresh one
            if self._create():
                self.held = True
                return
            holder = self._read_holder()
            if holder == {}:
                continue  # released meanwhile
            if holder is not None and _alive(holder) and not (_orphaned(holder) and self._outlive(holder)):
                raise FolderInUseError(
                    f"job.dump_folder '{self.folder}' is in use by a run on host {holder.get('host')} (pid "
                    f"{holder.get('pid')}, started {holder.get('started')}); wait for it, stop it, or choose another "
                    f"job.dump_folder. If that run is gone, delete {self.path}"
                )
            logger.warning(
                "job.dump_folder %s: taking over %s from a run that is gone (%s)",
                self.folder,
                LOCK_FILE,
                ", ".join(f"{k} {v}" for k, v in (holder or {"contents": "unreadable"}).items()),
            )
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        raise FolderInUseError(f"could not take {self.path}: other runs keep creating it; is one starting now?")

    def _outlive(self, holder: dict) -> bool:
        """Wait for an orphaned holder to stop (its parent watch ends it); True once it has."""
        wait = GRACE_SECONDS + 5 * POLL_SECONDS
        logger.warning(
            "job.dump_folder %s is held by pid %s, whose launcher is gone; waiting up to %.0f s for it to stop",
            self.folder,
            holder.get("pid"),
            wait,
        )
        deadline = time.monotonic() + wait
        while _alive(holder) and time.monotonic() < deadline:
            time.sleep(0.5)
        return not _alive(holder)

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.me, f)
        return True

    def _read_holder(self) -> dict | None:
        """The holder's record; {} if the lock is gone; None if unreadable (its writer died before writing)."""
        for attempt in range(3):
            try:
                with open(self.path) as f:
                    return json.load(f)
            except FileNotFoundError:
                return {}
            except (OSError, ValueError):
                if attempt < 2:
                    time.sleep(0.2)  # its writer may be between create and write
        return None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if not self.held:
            return
        self.held = False
        try:
            with open(self.path) as f:
                if json.load(f) != self.me:
                    return  # taken over meanwhile (someone judged us dead); leave theirs alone
            os.unlink(self.path)
        except (OSError, ValueError):
            pass


def check_dump_folder(config: JobConfig, dims: ParallelDims) -> list[str]:
    """This machine: the dump folder can be created and written (found before launch, nothing written)."""
    problem = folder_problem(config.job.dump_folder)
    if problem is not None:
        raise ConfigError(f"job.dump_folder = '{config.job.dump_folder}' cannot be written: {problem}")
    return []
