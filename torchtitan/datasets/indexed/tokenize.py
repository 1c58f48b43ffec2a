"""Tokenize a text corpus once into an indexed dataset (``scripts/tokenize_data.py`` is its command line).

Rows are read in order (local .jsonl/.json/.parquet files or folders, or a dataset in the local Hugging Face
cache), encoded in chunks by ``workers`` processes and written in row order, so the bytes are the same
whatever the number of workers. Each document is ``encode(text, bos=True, eos=True)``: EOS always, BOS when
the tokenizer has one (a Hugging Face tokenizer's config says; Qwen3 has none).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from torchtitan.datasets.indexed.format import IndexedWriter, dtype_for_vocab
from torchtitan.datasets.tokenizer import Tokenizer, build_tokenizer

CHUNK_DOCS = 256  # documents a worker encodes per task: big enough to amortise the pickling

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(tokenizer_path)


def encode_chunk(texts: Sequence[str], tokenizer: Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens back to back, tokens per document) of ``texts``."""
    tok = tokenizer or _worker_tokenizer
    assert tok is not None, "worker tokenizer not initialised"
    docs = [tok.encode(t, bos=True, eos=True) for t in texts]
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int32, count=len(docs))
    tokens = np.fromiter((t for d in docs for t in d), dtype=np.int64, count=int(lengths.sum()))
    return tokens, lengths


def load_rows(source: str, text_key: str):
    """The rows of a local file/folder or of a dataset in the local Hugging Face cache (nothing is downloaded).

    Raises:
        FileNotFoundError: neither a local path nor a cached dataset.
        ValueError: a bad file or row (named), or no ``text_key`` column.
    """
    path = Path(source).expanduser()
    if path.exists():
        from torchtitan.datasets.registry import load_local

        data = load_local(path, text_key)
    else:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the cache only: never the network
        from datasets import load_dataset

        try:
            data = load_dataset(source, split="train")
        except Exception as e:  # noqa: BLE001 - any failure means: not in the cache
            raise FileNotFoundError(
                f"--input '{source}' is not a local file/folder nor a dataset in the local Hugging Face cache "
                f"({type(e).__name__}); give a .jsonl/.json/.parquet file or folder"
            ) from e
    if text_key not in data.column_names:
        raise ValueError(
            f"--input '{source}' has no column {text_key!r} (columns: {data.column_names}); set --text_key"
        )
    return data


def _chunks(data, text_key: str) -> Iterator[list[str]]:
    for start in range(0, len(data), CHUNK_DOCS):
        yield data[start : start + CHUNK_DOCS][text_key]


class Progress:
    """A bar with documents/s, tokens/s and ETA on a terminal (redrawn in place), plain lines when redirected."""

    def __init__(self, total_docs: int, stream: TextIO, *, interval: float | None = None) -> None:
        self.total, self.stream = total_docs, stream
        self.tty = stream.isatty()
        self.interval = interval if interval is not None else (0.2 if self.tty else 10.0)
        self.start = self.last = time.perf_counter()

    def update(self, docs: int, tokens: int, *, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < self.interval:
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        rate = docs / elapsed
        eta = (self.total - docs) / rate if rate > 0 else 0.0
        pct = 100.0 * docs / self.total if self.total else 100.0
        text = (
            f"{docs}/{self.total} documents ({pct:.0f}%), {rate:,.0f} docs/s, {tokens / elapsed:,.0f} tokens/s, "
            f"ETA {eta:.0f} s"
        )
        if self.tty:
            filled = int(pct / 5)
            self.stream.write(f"\r[{'#' * filled}{'.' * (20 - filled)}] {text}" + ("\n" if final else ""))
        elif not final:
            self.stream.write(f"tokenize: {text}\n")
        self.stream.flush()


@dataclass(frozen=True)
class Summary:
    documents: int
    tokens: int
    bytes: int
    seconds: float

    def line(self, prefix: str, workers: int) -> str:
        return (
            f"tokenized {self.documents} documents, {self.tokens} tokens, {self.bytes} bytes "
            f"({prefix}.bin + .idx) in {self.seconds:.2f} s ({self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s, "
            f"{workers} worker{'s' if workers > 1 else ''})"
        )


def tokenize_to_indexed(
    source: str,
    output_prefix: str,
    tokenizer_path: str,
    *,
    workers: int = 1,
    text_key: str = "text",
    progress: TextIO | None = None,
) -> Summary:
    """Tokenize ``source`` into ``output_prefix.bin`` / ``.idx``; the bytes do not depend on ``workers``."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    start = time.perf_counter()
    tokenizer = build_tokenizer(tokenizer_path)
    data = load_rows(source, text_key)
    folder = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--output_prefix '{output_prefix}': the folder '{folder}' does not exist")
    writer = IndexedWriter(output_prefix, dtype_for_vocab(tokenizer.n_words))
    bar = Progress(len(data), progress or sys.stderr)
    pool = None
    try:
        if workers == 1:
            encoded = (encode_chunk(texts, tokenizer) for texts in _chunks(data, text_key))
        else:
            ctx = multiprocessing.get_context("fork")
            pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path,))
            encoded = pool.imap(encode_chunk, _chunks(data, text_key))  # in order: the output is the same
        for tokens, lengths in encoded:
            writer.add_documents(tokens, lengths)
            bar.update(writer.num_documents, writer.num_tokens)
        bar.update(writer.num_documents, writer.num_tokens, final=True)
        size = writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return Summary(writer.num_documents, writer.num_tokens, size, time.perf_counter() - start)
