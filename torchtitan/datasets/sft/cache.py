"""Fine-tuning rows tokenized once: the examples cached beside the data, keyed by data, template and tokenizer.

The first run to need a key takes an exclusive lock on it (``fcntl.flock``), tokenizes every row and writes
the examples (``sft-<key>.npz``: tokens, labels and each example's length, int32) under a temporary name,
then renames it; the other ranks block on the lock and then read the file: no rank repeats another's work,
and a later run reads the file instead of tokenizing. The key hashes each data file's absolute path, size and
modification time (a cached HF dataset: its own fingerprint), the tokenizer's files (``tokenizer.json`` and
``tokenizer_config.json``, so the chat template), the chat template in use, the format, ``loss_on``, the column
map and this file's version: change any and the rows are tokenized again. The cache sits in
``.torchtitan_cache/`` beside the (first) data file, or in ``~/.cache/torchtitan/sft`` when that folder is not
writable or the data is a cached HF dataset. A lock is per machine where the folder is not shared.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)
VERSION = 1  # of the cached examples' layout and of build_example's output; raise it when either changes
Example = tuple[Sequence[int], Sequence[int]]


def cache_key(
    source_names: Sequence[str], source_fingerprints: Sequence[str], tokenizer_file: str, **settings: Any
) -> str:
    """The hex key of a tokenization: the data (files by path, size, mtime), the tokenizer's files, ``settings``."""
    h = hashlib.sha256(f"v{VERSION}".encode())
    for name, fingerprint in zip(source_names, source_fingerprints):
        path = Path(name)
        if path.is_file():
            st = path.stat()
            h.update(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
        else:
            h.update(f"{name}|{fingerprint}".encode())
    tok = Path(tokenizer_file)
    for f in (tok, tok.with_name("tokenizer_config.json")):
        if f.is_file():
            h.update(hashlib.sha256(f.read_bytes()).digest())
    h.update(repr(sorted(settings.items())).encode())
    return h.hexdigest()[:32]


def cache_folder(first_source: str) -> Path:
    """``.torchtitan_cache`` beside the data file when writable, else the user's cache folder."""
    beside = Path(first_source).parent / ".torchtitan_cache"
    if Path(first_source).is_file():
        try:
            beside.mkdir(exist_ok=True)
            if os.access(beside, os.W_OK):
                return beside
        except OSError:
            pass
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchtitan" / "sft"
    home.mkdir(parents=True, exist_ok=True)
    return home


def _save(path: Path, examples: Sequence[Example]) -> None:
    lengths = np.fromiter((len(t) for t, _ in examples), dtype=np.int64, count=len(examples))
    tokens = np.concatenate([np.frombuffer(array("i", t), dtype=np.int32) for t, _ in examples])
    labels = np.concatenate([np.frombuffer(array("i", lab), dtype=np.int32) for _, lab in examples])
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with open(tmp, "wb") as f:
        np.savez(f, tokens=tokens, labels=labels, lengths=lengths)
    os.replace(tmp, path)


def _load(path: Path) -> list[Example]:
    with np.load(path) as data:
        tokens, labels, lengths = data["tokens"], data["labels"], data["lengths"]
    ends = np.cumsum(lengths)
    starts = ends - lengths
    tb, lb = tokens.tobytes(), labels.tobytes()
    out: list[Example] = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        t, lab = array("i"), array("i")
        t.frombytes(tb[4 * a : 4 * b])
        lab.frombytes(lb[4 * a : 4 * b])
        out.append((t, lab))
    return out


def cached_examples(folder: Path, key: str, tokenize: Callable[[], list[Example]]) -> tuple[list[Example], bool]:
    """(the examples, whether they came from the cache): read ``sft-<key>.npz``, or, holding the key's lock,
    tokenize and write it."""
    path = folder / f"sft-{key}.npz"
    with open(folder / f"sft-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process tokenizes; the others wait here, then read its file
        try:
            if path.is_file():
                start = time.perf_counter()
                examples = _load(path)
                logger.info(
                    "fine-tuning data: %d examples read from %s in %.1f s",
                    len(examples),
                    path,
                    time.perf_counter() - start,
                )
                return examples, True
            start = time.perf_counter()
            examples = tokenize()
            _save(path, examples)
            logger.info(
                "fine-tuning data: %d examples tokenized in %.1f s, cached in %s",
                len(examples),
                time.perf_counter() - start,
                path,
            )
            return examples, False
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
