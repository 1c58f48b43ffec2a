"""The sources of a blend as token streams cut into windows: indexed datasets (read on demand) or local text
(tokenized once at start, in memory), each read window by window in a seeded order that is new every epoch."""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from torchtitan.config.errors import ConfigError
from torchtitan.datasets.indexed.format import FileTokens, IndexedFile, check_vocab, find_prefixes
from torchtitan.datasets.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class WindowSource:
    """A token stream (the concatenation of ``parts``) cut into ``num_windows`` windows of ``window`` tokens.

    Window w is tokens ``[w * window, (w + 1) * window)``; the last partial window is never read. Epoch e of
    the source reads the windows in a permutation seeded by (seed, the source's name, e); local sample i is
    epoch ``i // num_windows``, position ``i % num_windows`` of that permutation.
    """

    def __init__(self, name: str, parts: list[np.ndarray | FileTokens], window: int, seed: int) -> None:
        self.name = name
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])  # token offset of each part
        self.num_tokens = int(self.starts[-1])
        self.window = window
        self.num_windows = self.num_tokens // window
        if self.num_windows == 0:
            raise ValueError(
                f"data source '{name}' has {self.num_tokens} tokens, fewer than one sample of training.seq_len + 1 = "
                f"{window}; use more data or a smaller seq_len"
            )
        self._seed = (seed, zlib.crc32(name.encode()))
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()
        self.epoch_logged = 0

    def order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s window order (the last two epochs' are kept)."""
        if epoch not in self._orders:
            rng = np.random.default_rng([*self._seed, epoch])
            self._orders[epoch] = rng.permutation(self.num_windows)
            while len(self._orders) > 2:
                self._orders.popitem(last=False)
            if epoch > self.epoch_logged:
                self.epoch_logged = epoch
                logger.warning(
                    "data source %s: all %d windows read; epoch %d, reshuffled", self.name, self.num_windows, epoch
                )
        return self._orders[epoch]

    def sample(self, i: int) -> np.ndarray:
        """Local sample ``i``: one window of ``window`` tokens."""
        epoch, pos = divmod(i, self.num_windows)
        start = int(self.order(epoch)[pos]) * self.window
        return self.read(start, self.window)

    def read(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens from offset ``start`` of the stream (across part boundaries)."""
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        offset = start - int(self.starts[k])
        if offset + count <= len(self.parts[k]):
            return self.parts[k][offset : offset + count]
        pieces, left = [], count
        while left:
            piece = self.parts[k][offset : offset + left]
            pieces.append(piece)
            left -= len(piece)
            k, offset = k + 1, 0
        return np.concatenate(pieces)


def indexed_parts(path: str, vocab_size: int, name: str) -> list[np.ndarray | FileTokens] | None:
    """The token arrays (read on demand) of the indexed dataset(s) ``path`` names, checked against the vocabulary;
    None when ``path`` names no indexed dataset."""
    prefixes = find_prefixes(path)
    if prefixes is None:
        return None
    files = [IndexedFile(p) for p in prefixes]
    for f in files:
        check_vocab(f, vocab_size, name)
    return [f.tokens for f in files if f.tokens is not None]


def text_parts(source: str, tokenizer: Tokenizer, key: str) -> list[np.ndarray]:
    """A local text file/folder or a registered local dataset, tokenized (bos/eos per document) into memory.

    Raises:
        ConfigError: a name that is neither an existing path nor a registered dataset, or a dataset streamed
            from the hub (tokenize it once with scripts/tokenize_data.py).
    """
    from datasets import Dataset

    from torchtitan.datasets.registry import DATASETS, load_local, load_text_dataset

    start = time.perf_counter()
    if os.path.exists(os.path.expanduser(source)):
        data, field = load_local(Path(source).expanduser(), "text"), "text"
    elif source in DATASETS:
        spec = DATASETS[source]
        if spec.default_path is None:
            raise ConfigError(
                f"{key} source '{source}' is streamed from the hub; tokenize a local copy once with "
                "scripts/tokenize_data.py and name its prefix instead"
            )
        data, field = load_text_dataset(source, None)
    else:
        raise ConfigError(
            f"{key} source '{source}' is neither an existing path (an indexed PREFIX, PREFIX.bin/.idx, a folder of "
            f"them, a .jsonl/.json/.parquet/.txt file or folder) nor a registered dataset ({sorted(DATASETS)})"
        )
    assert isinstance(data, Dataset)
    ids: list[int] = []
    for text in data[field]:
        ids.extend(tokenizer.encode(text, bos=True, eos=True))
    logger.info(
        "data source %s: %d documents, %d tokens, tokenized in memory in %.1f s (scripts/tokenize_data.py does "
        "it once for a large corpus)",
        source,
        len(data),
        len(ids),
        time.perf_counter() - start,
    )
    return [np.asarray(ids, dtype=np.int32)]


def build_sources(names: list[str], tokenizer: Tokenizer, seq_len: int, seed: int, key: str) -> list[WindowSource]:
    """One ``WindowSource`` per name: an indexed dataset where the name is one, else local text."""
    sources = []
    for name in names:
        parts = indexed_parts(name, tokenizer.n_words, f"{key} source '{name}'")
        if parts is None:
            parts = text_parts(name, tokenizer, key)
        sources.append(WindowSource(name, parts, seq_len + 1, seed))
    return sources
