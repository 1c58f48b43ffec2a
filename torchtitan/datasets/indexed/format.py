"""Megatron-LM's indexed dataset format (``MMIDIDX``, version 1): write it, read it window by window.

``PREFIX.bin`` is the token ids of every document back to back, in one integer dtype. ``PREFIX.idx`` is::

    9 bytes   b"MMIDIDX\\x00\\x00"
    8 bytes   version, little-endian uint64 = 1
    1 byte    dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    8 bytes   sequence count N, uint64
    8 bytes   document count D, uint64 (D = documents + 1: the indices below start with 0)
    N int32   sequence lengths (tokens)
    N int64   sequence pointers (byte offset of each sequence in .bin)
    D int64   document indices: the sequence index at which each document ends
    (N int8   sequence modes: only in multimodal files, not read here)

This is what megatron-core's ``IndexedDatasetBuilder`` writes (and ``tools/preprocess_data.py`` through it):
``scripts/tokenize_data.py`` writes one sequence per document, as Megatron does without sentence splitting,
and tests/unit/test_indexed_format.py checks the bytes are the same as the builder's.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype 1 + sequence count 8 + document count 8
DTYPES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(t): c for c, t in DTYPES.items()}
SUFFIXES = (".bin", ".idx")


def dtype_for_vocab(vocab_size: int) -> type[np.number]:
    """Megatron's ``DType.optimal_dtype``: uint16 below 65,500 words, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def write_index(path: str, dtype: type[np.number], lengths: np.ndarray) -> None:
    """Write the ``.idx`` of documents of ``lengths`` tokens each (one sequence per document)."""
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths):
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    documents = np.arange(len(lengths) + 1, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODES[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(documents)))
        for array in (lengths, pointers, documents):
            f.write(array.tobytes(order="C"))


def split_prefix(path: str) -> str:
    """``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx`` -> ``PREFIX``."""
    return path[:-4] if path.endswith(SUFFIXES) else path


def find_prefixes(path: str) -> list[str] | None:
    """The indexed datasets ``path`` names (a prefix, one of its two files, or a folder of them, sorted), or None
    when it names none (then it is text data).

    Raises:
        FileNotFoundError: a .bin without its .idx or the other way round.
    """
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        prefixes = sorted({os.path.join(path, split_prefix(n)) for n in names if n.endswith(SUFFIXES)})
    else:
        prefix = split_prefix(path)
        named = path.endswith(SUFFIXES)
        prefixes = [prefix] if named or any(os.path.exists(prefix + s) for s in SUFFIXES) else []
    if not prefixes:
        return None
    for prefix in prefixes:
        for have, want in (SUFFIXES, SUFFIXES[::-1]):
            if not os.path.isfile(prefix + want):
                there = "is there but " if os.path.isfile(prefix + have) else ""
                raise FileNotFoundError(
                    f"indexed dataset '{prefix}': '{prefix}{have}' {there}'{prefix}{want}' is missing; an indexed "
                    "dataset is a .bin and an .idx with the same prefix (scripts/tokenize_data.py writes both)"
                )
    return prefixes


def read_header(idx_path: str) -> tuple[type[np.number], int, int]:
    """(dtype, sequence count, document count) of an ``.idx``.

    Raises:
        ValueError: another magic, version or dtype code, or a file shorter than its header says.
    """
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:9] != MAGIC:
        raise ValueError(
            f"'{idx_path}' is not a Megatron-LM indexed dataset index: it does not start with {MAGIC!r}; "
            "write it with scripts/tokenize_data.py (or Megatron's tools/preprocess_data.py)"
        )
    (version,) = struct.unpack("<Q", head[9:17])
    if version != VERSION:
        raise ValueError(f"'{idx_path}' is index version {version}; only version {VERSION} (MMIDIDX) is read")
    code = head[17]
    if code not in DTYPES or DTYPES[code] in (np.float32, np.float64):
        allowed = ", ".join(f"{c} ({DTYPES[c].__name__})" for c in DTYPES if c not in (6, 7))
        raise ValueError(f"'{idx_path}' has token dtype code {code}; token ids need an integer code: {allowed}")
    sequences, documents = struct.unpack("<QQ", head[18:34])
    need = HEADER_BYTES + sequences * 12 + documents * 8
    if size < need:
        raise ValueError(
            f"'{idx_path}' is {size} bytes, its header ({sequences} sequences, {documents} document indices) needs "
            f"{need}; the file is truncated: write it again"
        )
    return DTYPES[code], sequences, documents


class FileTokens:
    """The token ids of a ``.bin``, sliced like an array: each slice is one positioned read (``os.pread``) of just
    those tokens. Reads come from the page cache like a memory map's, but nothing stays mapped into the process:
    its memory does not grow with the part of the corpus read so far (bench/data.py measures it)."""

    def __init__(self, path: str, dtype: type[np.number], num_tokens: int) -> None:
        self.path, self.dtype, self.num_tokens = path, np.dtype(dtype), num_tokens
        self._fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(self.num_tokens)
        assert step == 1, "token reads are contiguous"
        count = max(stop - start, 0)
        data = os.pread(self._fd, count * self.dtype.itemsize, start * self.dtype.itemsize)
        return np.frombuffer(data, dtype=self.dtype, count=count)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


class IndexedFile:
    """One ``PREFIX``: its token ids read on demand (nothing of the corpus is read until a window is asked for).

    Only the index's header and last sequence are read here: memory grows with what is touched, never with the
    corpus. Sequences are read as one token stream, in file order (a Megatron file's pointers are consecutive).
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        self.dtype, sequences, _ = read_header(idx_path)
        itemsize = np.dtype(self.dtype).itemsize
        if sequences:
            with open(idx_path, "rb") as f:
                f.seek(HEADER_BYTES + (sequences - 1) * 4)
                (last_length,) = struct.unpack("<i", f.read(4))
                f.seek(HEADER_BYTES + sequences * 4 + (sequences - 1) * 8)
                (last_pointer,) = struct.unpack("<q", f.read(8))
            need = last_pointer + last_length * itemsize
        else:
            need = 0
        have = os.path.getsize(bin_path)
        if have < need:
            raise ValueError(
                f"'{bin_path}' is {have} bytes, shorter than the {need} its index says; the file is truncated "
                "or belongs to another index: write both again"
            )
        self.num_tokens = need // itemsize
        self.tokens = FileTokens(bin_path, self.dtype, self.num_tokens) if need else None

    def max_id_bound(self) -> int:
        """The largest id the dtype can hold."""
        return int(np.iinfo(self.dtype).max)


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchtitan" / "indexed_max_id"


def id_range(file: IndexedFile) -> tuple[int, int]:
    """(min, max) token id of ``file``, read once in chunks and cached by path, size and mtime."""
    stat = os.stat(file.prefix + ".bin")
    key = hashlib.sha1(f"{os.path.abspath(file.prefix)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    cached = _cache_dir() / f"{key}.json"
    if cached.is_file():
        try:
            got = json.loads(cached.read_text())
            return int(got["min"]), int(got["max"])
        except (ValueError, KeyError):
            pass  # a broken cache entry is read again
    low, high, chunk = 0, -1, 1 << 24
    with open(file.prefix + ".bin", "rb") as f:  # read, not mapped: the scan leaves nothing resident
        for start in range(0, file.num_tokens, chunk):
            part = np.fromfile(f, dtype=file.dtype, count=min(chunk, file.num_tokens - start))
            low, high = min(low, int(part.min())), max(high, int(part.max()))
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"min": low, "max": high, "prefix": os.path.abspath(file.prefix)}))
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only home: scanned again next time
    return low, high


def check_vocab(file: IndexedFile, vocab_size: int, name: str) -> None:
    """Every token id of ``file`` is in [0, vocab_size): free when the dtype cannot hold a larger one, else one
    cached scan of the file.

    Raises:
        ValueError: an id out of range, naming the file, the id and the vocabulary.
    """
    if file.tokens is None:
        return
    signed = np.issubdtype(file.dtype, np.signedinteger)
    if file.max_id_bound() < vocab_size and not signed:
        return
    low, high = id_range(file)
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        raise ValueError(
            f"{name}: '{file.prefix}.bin' holds token id {bad}, outside the model's vocabulary [0, {vocab_size}) "
            "(model.tokenizer_path); tokenize the data with the run's tokenizer"
        )


class IndexedWriter:
    """Writes ``PREFIX.bin`` / ``PREFIX.idx`` document by document, under temporary names until ``finish``: an
    interrupted write leaves nothing under the final names (a rerun starts over, overwriting the leftovers)."""

    def __init__(self, prefix: str, dtype: type[np.number]) -> None:
        self.prefix, self.dtype = prefix, dtype
        self.bin_tmp, self.idx_tmp = prefix + ".bin.partial", prefix + ".idx.partial"
        self._bin = open(self.bin_tmp, "wb")
        self._lengths: list[np.ndarray] = []
        self.num_tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents of ``lengths`` tokens each, back to back in ``tokens``."""
        self._bin.write(np.asarray(tokens, dtype=self.dtype).tobytes(order="C"))
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self.num_tokens += int(len(tokens))

    @property
    def num_documents(self) -> int:
        return sum(len(x) for x in self._lengths)

    def finish(self) -> int:
        """Write the index and move both files to their names; returns the bytes written."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int32)
        write_index(self.idx_tmp, self.dtype, lengths)
        for tmp in (self.bin_tmp, self.idx_tmp):
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        # the old index goes first: a crash between the two moves leaves a .bin without .idx (refused), never a
        # new .bin read through an old index
        if os.path.exists(self.prefix + ".idx"):
            os.remove(self.prefix + ".idx")
        os.replace(self.bin_tmp, self.prefix + ".bin")
        os.replace(self.idx_tmp, self.prefix + ".idx")
        return os.path.getsize(self.prefix + ".bin") + os.path.getsize(self.prefix + ".idx")

    def abort(self) -> None:
        """Remove the partial files."""
        self._bin.close()
        for tmp in (self.bin_tmp, self.idx_tmp):
            if os.path.exists(tmp):
                os.remove(tmp)
