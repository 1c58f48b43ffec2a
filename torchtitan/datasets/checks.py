"""Pre-launch checks of this machine's data files: the tokenizer and the dataset paths. Light: the
preflight runs them before every launch, so nothing of the data stack is imported here."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from torchtitan.datasets.indexed.checks import check_indexed_data

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims


def _looks_local(path: str | None) -> bool:
    """A hub id looks like "org/name"; anything that starts like a filesystem path must exist."""
    return path is not None and path.startswith((".", "/", "~"))


def _exists(path: str) -> bool:
    """A file or folder, or an indexed dataset's PREFIX (PREFIX.bin / PREFIX.idx)."""
    path = os.path.expanduser(path)
    return os.path.exists(path) or any(os.path.exists(path + suffix) for suffix in (".bin", ".idx"))


def check_data_paths(config: JobConfig, dims: ParallelDims) -> list[str]:
    """The tokenizer file, and the training and (when on) validation datasets given as local paths, exist; a
    dataset_mix and indexed datasets check out (datasets/indexed/checks.py)."""
    path = config.model.tokenizer_path
    # a file, or a folder holding tokenizer.json (build_tokenizer's rule)
    if not os.path.isfile(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        problem = "is a folder without tokenizer.json" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(
            f"model.tokenizer_path = '{path}' {problem}; use the shipped "
            "./torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken or fetch Llama 3's (tokenizer.model) "
            "or Qwen3's (tokenizer.json) with scripts/download_tokenizer.py"
        )
    data = config.training.dataset_path
    if _looks_local(data) and not _exists(data):
        raise FileNotFoundError(f"training.dataset_path = '{data}' does not exist")
    v = config.validation
    if v.enabled and _looks_local(v.dataset_path) and not _exists(v.dataset_path):
        raise FileNotFoundError(f"validation.dataset_path = '{v.dataset_path}' does not exist")
    return check_indexed_data(config)
