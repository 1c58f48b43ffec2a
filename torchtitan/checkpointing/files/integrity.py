"""Checkpoint integrity: a CRC32 of every data file, taken as DCP writes it, and loading that runs no foreign code.

Writing: ``ChecksummingWriter`` is DCP's ``FileSystemWriter`` whose file streams update a CRC32
as the bytes go out. When a rank closes a data file (``__<rank>_<i>.distcp``) it writes a sidecar
``<file>.crc32`` (JSON: size, crc32) beside it, before it reports its write results to DCP's
coordinator; so once ``.metadata`` exists every sidecar does, and rank 0 copies them into the
``.complete`` marker (folders.list_files) without reading the data back.

Loading: ``.metadata`` is a pickle. ``read_metadata_file`` (and ``RestrictedReader``, for
``dcp.load``) unpickle it admitting only the types DCP puts there; anything else is a
``ForeignPickleError`` and is never called. ``WeightsOnlyLoadPlanner`` does the same for the
non-tensor entries (LR scheduler, data loader state, the step): each must parse with torch's
weights-only unpickler before DCP loads it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from torchtitan.checkpointing.files.format import upgrade_metadata
from torchtitan.checkpointing.files.marker import read_marker
from torchtitan.checkpointing.files.storage import FSSPEC_OPTIONS, is_url, open_file

SIDECAR_SUFFIX = ".crc32"  # "__0_0.distcp" -> "__0_0.distcp.crc32"
DATA_SUFFIX = DEFAULT_SUFFIX  # ".distcp"
_CHUNK = 16 * 1024 * 1024  # verification reads files in pieces of this size, never whole

_DCP = "torch.distributed.checkpoint"
# Every global a torch 2.13 ``.metadata`` pickle names (found with pickletools on real checkpoints:
# one process, FSDP, async), plus plain containers. All are data types or pure lookups.
_ALLOWED_GLOBALS = frozenset(
    [(f"{_DCP}.filesystem", "_StorageInfo")]
    + [
        (f"{_DCP}.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ]
    + [("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")]
    # StorageMeta.checkpoint_id is the save's path (pathlib moved its classes in Python 3.13)
    + [(module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")]
    + [("builtins", name) for name in ("dict", "list", "tuple", "set", "frozenset", "bytearray", "complex")]
)


class ForeignPickleError(ValueError):
    """A checkpoint file holds a pickle of something other than plain checkpoint data."""


# ---- writing -----------------------------------------------------------------------------------


class _CrcStream(io.IOBase):
    """A write-only file stream that keeps the CRC32 and count of the bytes written through it."""

    def __init__(self, raw: io.IOBase):
        self._raw = raw
        self.size = 0
        self.crc: int | None = 0  # None: the writer seeked, so the running CRC is not the file's

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        written = len(view) if written is None else written
        if self.crc is not None:
            self.crc = zlib.crc32(view[:written], self.crc)
        self.size += written
        return written

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.crc = None
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes first
            self._raw.close()


class _Checksumming:
    """File-system mixin: a data file's stream keeps a CRC32, and closing it writes the sidecar."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as raw:  # type: ignore[misc]
            if mode != "wb" or not str(path).endswith(DATA_SUFFIX):
                yield raw  # .metadata (small; rank 0 checksums it directly) and reads
                return
            stream = _CrcStream(raw)
            yield stream
        if stream.crc is not None:  # without a sidecar the marker records the size only
            write_sidecar(str(path), stream.size, stream.crc)


class _ChecksummingFileSystem(_Checksumming, FileSystem):
    pass


class _StoreFileSystem(FsspecFileSystem):
    """DCP's fsspec file system, always with ``FSSPEC_OPTIONS`` (DCP re-inits the path on every save and load)."""

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str | os.PathLike:
        return super().init_path(path, **{**FSSPEC_OPTIONS, **kwargs})


class _ChecksummingStoreFileSystem(_Checksumming, _StoreFileSystem):
    pass


class ChecksummingWriter(FileSystemWriter):
    """DCP's file-system writer; each data file gets a ``.crc32`` sidecar computed from the bytes as written.

    Works for ``dcp.save`` and ``dcp.async_save`` (its background thread writes through the same
    streams), with or without a process group: every rank writes its own files' sidecars. A URL
    (checkpointing/storage.py) is written through fsspec, as DCP's ``FsspecWriter`` does, with the
    same sidecars; its objects are not fsynced (an upload is durable once it returns, and the
    stream has no file descriptor: DCP would sync the whole machine's disks instead).
    """

    def __init__(self, path: str | os.PathLike, **kwargs: Any):
        remote = is_url(path)
        if remote:
            kwargs.setdefault("sync_files", False)
        super().__init__(path, **kwargs)
        self.fs = _ChecksummingStoreFileSystem() if remote else _ChecksummingFileSystem()
        self.path = self.fs.init_path(path)


def write_sidecar(data_path: str, size: int, crc: int) -> None:
    with open_file(data_path + SIDECAR_SUFFIX, "wb") as f:
        f.write(json.dumps({"size": size, "crc32": crc}).encode())


def read_sidecar(data_path: str) -> tuple[int, int] | None:
    """(size, crc32) the writer recorded for ``data_path``; None if it wrote none (or it is unreadable)."""
    try:
        with open_file(data_path + SIDECAR_SUFFIX, "rb") as f:
            body = json.load(f)
        return int(body["size"]), int(body["crc32"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def crc32_of_file(path: str) -> int:
    """CRC32 of a file's bytes, read in 16 MiB pieces."""
    crc = 0
    with open_file(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


# ---- loading -----------------------------------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise ForeignPickleError(
                f"checkpoint {self.path} holds a pickle of {module}.{name}, which is not DCP metadata; "
                "refusing to load it (it could run code)"
            )
        return super().find_class(module, name)


def read_metadata_file(path: str) -> Metadata:
    """Unpickle a DCP ``.metadata`` file admitting only DCP's metadata types; the keys of an older checkpoint
    format come renamed to this release's (checkpointing/format.py, from the folder's marker).

    Raises:
        ForeignPickleError: the pickle names any other type or function (it is not called).
    """
    with open_file(path, "rb") as f:
        metadata = _MetadataUnpickler(f, path).load()
    if not isinstance(metadata, Metadata):
        raise ForeignPickleError(f"checkpoint {path} holds a {type(metadata).__name__}, not DCP metadata")
    return upgrade_metadata(metadata, lambda: read_marker(os.path.dirname(path)))  # an older format's keys, renamed


class RestrictedReader(FileSystemReader):
    """DCP's file-system reader whose ``read_metadata`` is ``read_metadata_file``; pass it to ``dcp.load``. A URL
    is read through fsspec (as DCP's ``FsspecReader`` does)."""

    refused: ForeignPickleError | None = None  # what read_metadata refused, for load() to report

    def __init__(self, path: str | os.PathLike, **kwargs: Any):
        super().__init__(path, **kwargs)
        if is_url(path):
            self.fs = _StoreFileSystem()
            self.path = self.fs.init_path(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            metadata = read_metadata_file(str(self._get_metadata_path(kwargs.get("rank"))))
        except ForeignPickleError as e:
            self.refused = e
            raise
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyBytes:
    """Planner mixin: a non-tensor entry must parse with torch's weights-only unpickler first.

    DCP then loads it with ``torch.load(weights_only=False)`` from the same bytes, which can only
    reach the globals the weights-only pass admitted (plain containers, numbers, strings, tensors).
    """

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            lines = [line for line in str(e).splitlines() if "GLOBAL" in line] or str(e).splitlines()[:1]
            raise ForeignPickleError(
                f"checkpoint entry {read_item.dest_index.fqn} is not plain data; refusing to load it "
                f"(it could run code): {lines[0] if lines else type(e).__name__}"
            ) from e
        value.seek(0)
        super().load_bytes(read_item, value)  # type: ignore[misc]


class WeightsOnlyLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """DCP's default load planner; non-tensor entries are checked as ``_WeightsOnlyBytes`` says."""


class _WholeCheckpointPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    pass


def load_whole_checkpoint(path: str) -> dict[str, Any]:
    """One process: every entry of a DCP checkpoint as a nested dict, read with the checks above.

    What torch's ``dcp_to_torch_save`` loads (it uses the same private ``_load_state_dict`` and
    planner), without unpickling foreign code.

    Raises:
        ValueError: one line naming what failed (a ``ForeignPickleError`` as it is).
    """
    read_metadata_file(os.path.join(path, ".metadata"))  # its refusal, not DCP's retry of a rank-local file
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=RestrictedReader(path), planner=_WholeCheckpointPlanner(), no_dist=True)
    except CheckpointException as e:  # a BaseException carrying each rank's error
        errors = "; ".join(f"{type(exc).__name__}: {exc}" for exc, _ in e.failures.values())
        raise ValueError(f"checkpoint {path} could not be loaded: {errors}") from e
    return state


# ---- the DCP calls, with the writer, reader and planner above ------------------------------------


def save(state: dict[str, Any], path: str, *, process_group: Any = None, no_dist: bool = False) -> None:
    """``dcp.save`` through ``ChecksummingWriter``."""
    dcp.save(
        state, checkpoint_id=path, storage_writer=ChecksummingWriter(path), process_group=process_group, no_dist=no_dist
    )


def async_save(
    state: dict[str, Any],
    path: str,
    *,
    process_group: Any = None,
    no_dist: bool = False,
    copier: AsyncStager | None = None,
) -> tuple[Future | None, Future]:
    """``dcp.async_save`` through ``ChecksummingWriter`` (its background thread writes the sidecars).

    Returns:
        (copied, written): ``written`` completes once the files and ``.metadata`` are written. Without ``copier``
        (torch's async stager) the writer copies the state before this returns and ``copied`` is None; with one
        that copies in the background (checkpointing/staging.py) ``copied`` completes once its copy is done (until
        then the state's tensors must not change).
    """
    response = dcp.async_save(
        state,
        checkpoint_id=path,
        storage_writer=ChecksummingWriter(path),
        process_group=process_group,
        no_dist=no_dist,
        async_stager=copier,
    )
    if isinstance(response, AsyncSaveResponse):
        return response.staging_completion, response.upload_completion
    return None, response


def load(state: dict[str, Any], path: str, *, process_group: Any = None, no_dist: bool = False) -> None:
    """``dcp.load`` through ``RestrictedReader`` and ``WeightsOnlyLoadPlanner``.

    Raises:
        CheckpointException: DCP's, naming each rank's error.
        ForeignPickleError: the refused ``.metadata``, where DCP reported only "metadata is None" (torch
            2.11 drops the reader's error; 2.12 and later name it inside their CheckpointException).
    """
    reader = RestrictedReader(path)
    try:
        dcp.load(
            state,
            checkpoint_id=path,
            storage_reader=reader,
            planner=WeightsOnlyLoadPlanner(),
            process_group=process_group,
            no_dist=no_dist,
        )
    except CheckpointException as e:
        if reader.refused is not None and str(reader.refused) not in str(e):
            raise reader.refused from e
        raise
