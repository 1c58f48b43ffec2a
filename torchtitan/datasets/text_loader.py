"""The pre-training loader of one data-parallel rank: indexed data or a blend (datasets/indexed/), else text streams
(hf_datasets.py). Both keep the invariant that global batch k is a function of k only (docs/data.md)."""

from __future__ import annotations

from torchtitan.config.mix import MixEntry, parse_mix
from torchtitan.datasets.hf_datasets import ParallelAwareDataloader, build_hf_data_loader
from torchtitan.datasets.indexed.format import find_prefixes
from torchtitan.datasets.tokenizer import Tokenizer


def build_text_data_loader(
    dataset_name: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    seq_len: int,
    stream_groups: list[list[int]],
    num_streams: int,
    *,
    mix: list[str] | None = None,
    seed: int = 0,
    restart_mix: bool = False,
) -> ParallelAwareDataloader:
    """A blend (``mix``: ``training.dataset_mix``'s entries) or an indexed ``dataset_path`` is read window by window
    (``seed``: its shuffle; ``restart_mix``: ``training.dataset_mix_restart``); anything else as text streams.
    The other arguments are ``build_hf_data_loader``'s."""
    if mix is None and (dataset_path is None or find_prefixes(dataset_path) is None):
        return build_hf_data_loader(dataset_name, dataset_path, tokenizer, seq_len, stream_groups, num_streams)
    from torchtitan.datasets.indexed.loader import build_indexed_data_loader

    entries = parse_mix(mix) if mix is not None else [MixEntry(str(dataset_path), 1.0)]
    key = "training.dataset_mix" if mix is not None else "dataset_path"
    return build_indexed_data_loader(
        entries, tokenizer, seq_len, stream_groups, num_streams, seed=seed, restart_mix=restart_mix, key=key
    )
