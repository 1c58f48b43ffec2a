"""Pre-launch check of ``training.dataset_mix`` and of indexed datasets named by a ``dataset_path``: weights,
source names, and each indexed file's header and size (read in microseconds; the token ids are checked against
the vocabulary when the loader starts, once per file, cached). Light: nothing of the data stack is imported."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from torchtitan.config.errors import ConfigError
from torchtitan.config.mix import MIX_KEY, parse_mix
from torchtitan.datasets.indexed.format import IndexedFile, find_prefixes

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.config.schema import Training

# registry.py's names without a local default (streamed from the hub); tests/unit/test_indexed_loader.py keeps
# them equal, so this check knows them without importing the data stack
STREAMED = ("c4", "c4_validation", "fineweb")


def _check_files(path: str, key: str, seq_len: int) -> bool:
    """Open the indexed dataset(s) ``path`` names (header, sizes; at least one sample of ``seq_len + 1``
    tokens); False when it names none."""
    prefixes = find_prefixes(path)
    if prefixes is None:
        return False
    tokens = 0
    for prefix in prefixes:
        try:
            tokens += IndexedFile(prefix).num_tokens
        except ValueError as e:
            raise ConfigError(f"{key} = '{path}': {e}") from e
    if tokens < seq_len + 1:
        raise ConfigError(
            f"{key} = '{path}' has {tokens} tokens, fewer than one sample of training.seq_len + 1 = {seq_len + 1}; "
            "use more data or a smaller seq_len"
        )
    return True


def _check_source(source: str, seq_len: int) -> None:
    from torchtitan.config.schema import DatasetName  # the registry's names, without the data stack

    if _check_files(source, f"{MIX_KEY} source", seq_len):
        return
    if os.path.exists(os.path.expanduser(source)):
        return  # local text: tokenized in memory at start
    names = DatasetName.__args__
    if source not in names:
        raise ConfigError(
            f"{MIX_KEY} source '{source}' is neither an existing path (an indexed PREFIX, PREFIX.bin/.idx, a folder "
            f"of them, a .jsonl/.json/.parquet/.txt file or folder) nor a registered dataset ({sorted(names)})"
        )
    if source in STREAMED:
        raise ConfigError(
            f"{MIX_KEY} source '{source}' is streamed from the hub; tokenize a local copy once with "
            "scripts/tokenize_data.py and name its prefix instead"
        )


def check_indexed_data(config: JobConfig) -> list[str]:
    """The mix parses and its sources exist; indexed files (of the mix or a dataset_path) open."""
    t: Training = config.training
    if t.dataset_mix is not None:
        if t.dataset_format != "text":
            raise ConfigError(
                f"{MIX_KEY} blends pre-training text; training.dataset_format = '{t.dataset_format}' reads fine-tuning "
                "rows: unset one of them"
            )
        if t.dataset_path is not None:
            raise ConfigError(
                f"{MIX_KEY} and training.dataset_path = '{t.dataset_path}' are both set; the mix names every source "
                "(add it there with a weight) and dataset_path is unused: unset it"
            )
        for entry in parse_mix(t.dataset_mix):
            _check_source(entry.source, t.seq_len)
    elif t.dataset_path is not None and _check_files(t.dataset_path, "training.dataset_path", t.seq_len):
        if t.dataset_format != "text":
            raise ConfigError(
                f"training.dataset_path = '{t.dataset_path}' is an indexed dataset (pre-training tokens); "
                f"training.dataset_format = '{t.dataset_format}' needs fine-tuning rows"
            )
    v = config.validation
    if v.enabled and v.dataset_path is not None:
        _check_files(v.dataset_path, "validation.dataset_path", t.seq_len)
    return []
