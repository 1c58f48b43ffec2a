"""Where checkpoints live: a local folder or an fsspec URL (``s3://bucket/prefix``, ``gs://bucket/prefix``).

One small interface over both for the checkpoint code (folders.py, marker.py, integrity.py, the manager). A local
path keeps the os/shutil calls it always made, ``os.replace``'s atomic renames included; a URL goes through the
fsspec filesystem of its protocol (``fsspec.core.url_to_fs``: ``s3://`` needs s3fs, ``gs://`` gcsfs). A
``file://`` URL is a local path.

An object store is not a file system in three ways the callers rely on:

* a folder is a key prefix: it exists while an object under it does, and making one does nothing;
* writing an object is atomic (a reader sees all of it or none) and there is no rename: a move is copy + delete;
* listings are read fresh (``use_listings_cache=False``): other ranks and other runs write the same prefix, and
  fsspec's listing cache would hide their objects from this process.

Credentials, region and endpoint are the protocol library's own business (for ``s3://`` botocore's: the
environment, ``~/.aws/``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``); nothing here reads or logs them.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import socket
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

# The options of every URL filesystem the checkpoint code opens (DCP's writer and reader included), so all of
# them share fsspec's one cached instance per protocol.
FSSPEC_OPTIONS: dict[str, Any] = {"use_listings_cache": False}
_FILE = "file://"


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a URL of a remote store (``file://`` is not: it names a local path)."""
    path = os.fspath(path)
    return "://" in path and not path.startswith(_FILE)


def local_path(path: str) -> str:
    """``path`` without a ``file://`` prefix."""
    return path[len(_FILE) :] if path.startswith(_FILE) else path


def under(base: str, folder: str) -> str:
    """``folder`` relative to the local folder ``base``; a URL (or an absolute path) as it is."""
    if "://" in folder:
        return local_path(folder)
    return os.path.join(base, folder)


def protocol(url: str) -> str:
    return url.split("://", 1)[0]


def filesystem(url: str, **options: Any) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem of ``url`` and the path in it (``FSSPEC_OPTIONS`` plus ``options``)."""
    from fsspec.core import url_to_fs

    return url_to_fs(url, **{**FSSPEC_OPTIONS, **options})


def _name(entry: dict[str, Any]) -> str:
    return posixpath.basename(entry["name"].rstrip("/"))


def _listing(url: str) -> list[dict[str, Any]]:
    """The entries directly under ``url`` (FileNotFoundError when there are none)."""
    fs, path = filesystem(url)
    return fs.ls(path, detail=True)


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = filesystem(path)
    return fs.exists(p)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, p = filesystem(path)
    return fs.isdir(p)


def subfolders(path: str) -> list[str]:
    """The names of the folders directly in ``path``; none when it does not exist."""
    if not is_url(path):
        if not os.path.isdir(path):
            return []
        return [name for name in os.listdir(path) if os.path.isdir(os.path.join(path, name))]
    try:
        return [_name(e) for e in _listing(path) if e["type"] == "directory"]
    except FileNotFoundError:
        return []


def files(path: str) -> dict[str, int]:
    """The files directly in the folder ``path`` -> their sizes in bytes (one listing on a store).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    if not is_url(path):
        return {
            name: os.path.getsize(full) for name in os.listdir(path) if os.path.isfile(full := os.path.join(path, name))
        }
    return {_name(e): int(e["size"]) for e in _listing(path) if e["type"] == "file"}


def open_file(path: str, mode: str = "rb") -> IO:
    """``open``; on a store the object is written when the file closes."""
    if not is_url(path):
        return open(path, mode)
    fs, p = filesystem(path)
    return fs.open(p, mode)


def write_object(path: str, data: bytes) -> None:
    """Write ``data`` as ``path`` on a store, in one request: readers see no object or all of it."""
    fs, p = filesystem(path)
    fs.pipe_file(p, data)


def makedirs(path: str, *, exist_ok: bool = False) -> None:
    """``os.makedirs``; nothing to make on an object store (its folders are key prefixes)."""
    if not is_url(path):
        os.makedirs(path, exist_ok=exist_ok)
        return
    fs, p = filesystem(path)
    fs.makedirs(p, exist_ok=True)


def remove(path: str) -> None:
    if not is_url(path):
        os.remove(path)
        return
    fs, p = filesystem(path)
    fs.rm_file(p)


def rmtree(path: str, *, ignore_errors: bool = False) -> None:
    """``shutil.rmtree``; on a store every object under the prefix ``path/``."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=ignore_errors)
        return
    fs, p = filesystem(path)
    try:
        fs.rm(p, recursive=True)
    except OSError:  # what the store answered (fsspec's translation of its errors)
        if not ignore_errors:
            raise


def copy_file(src: str, dst: str) -> None:
    """Copy one object to another key of the same store (server side where the store can)."""
    fs, p = filesystem(src)
    fs.copy(p, filesystem(dst)[1])


# ---- the pre-launch check's questions (checkpointing/checks.py names the key) -------------------------------


def missing_package(url: str) -> str | None:
    """Why fsspec cannot open ``url``'s protocol on this machine (its package is not installed, or fsspec knows no
    such protocol); None if it can. Nothing is imported or contacted."""
    import importlib.util

    from fsspec.registry import known_implementations

    proto = protocol(url)
    known = known_implementations.get(proto)
    if known is None:
        return f"has a protocol fsspec does not know ('{proto}://'; s3://, gs://, az://, ... and file:// are)"
    package = known["class"].split(".", 1)[0]
    if importlib.util.find_spec(package) is None:
        return (
            f"needs the {package} package (fsspec's {proto}:// filesystem), which is not installed here: "
            f"pip install {package}"
        )
    return None


def access_problem(url: str, *, write: bool) -> str | None:
    """Why this process cannot use ``url`` (with ``write``: write and delete a small object there; else: list it),
    as the store answers with the credentials the protocol's library finds now; None if it can. A missing prefix
    to read is not a problem here (the caller says what is missing)."""
    fs, path = filesystem(url, skip_instance_cache=True)  # this environment's credentials, not a cached session's
    try:
        if write:
            probe = posixpath.join(path, f".write-check-{socket.gethostname()}-{os.getpid()}")
            fs.pipe_file(probe, b"")
            fs.rm_file(probe)
        else:
            fs.ls(path)
    except FileNotFoundError as e:
        if not write:
            return None
        return f"cannot be written: {_one_line(e)} (create the bucket, or fix the URL)"
    except PermissionError as e:
        return (
            f"cannot be {'written' if write else 'read'}: access denied ({_one_line(e)}); check the credentials "
            f"{protocol(url)}:// reads from the environment and its config files (s3://: AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE and ~/.aws/) and what they may do in that bucket"
        )
    except Exception as e:  # noqa: BLE001 - whatever the store's library raised, as one line
        return f"cannot be {'written' if write else 'read'}: {type(e).__name__}: {_one_line(e)}"
    return None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
