"""Data: tokenizers and the stateful, parallel-layout-invariant text pipeline."""

from __future__ import annotations

from torchtitan.datasets.hf_datasets import (
    HuggingFaceDataset,
    ParallelAwareDataloader,
    build_hf_data_loader,
    compute_stream_groups,
    merge_data_states,
)
from torchtitan.datasets.registry import DATASETS, DEFAULT_DATASET
from torchtitan.datasets.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer, build_tokenizer

__all__ = [
    "DATASETS",
    "DEFAULT_DATASET",
    "DEFAULT_TOKENIZER_PATH",
    "HuggingFaceDataset",
    "ParallelAwareDataloader",
    "Tokenizer",
    "build_hf_data_loader",
    "build_tokenizer",
    "compute_stream_groups",
    "merge_data_states",
]
