"""The fine-tuning loader (``training.dataset_format`` chat / prompt_completion): text rows through
datasets/sft/loader.py, image-text rows (an images column) through datasets/vision/loader.py; the same packing and
data order for both."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtitan.datasets.hf_datasets import ParallelAwareDataloader
from torchtitan.datasets.sft.columns import parse_columns
from torchtitan.datasets.sft.loader import SFTDataset, chat_tokenizer, load_rows, tokenize_cached
from torchtitan.datasets.vision.loader import build_image_dataset, has_image_column

if TYPE_CHECKING:
    from torchtitan.config.schema import Training
    from torchtitan.datasets.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def build_sft_data_loader(
    dataset_name: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    training: Training,
    stream_groups: list[list[int]],
    num_streams: int,
    model_args: Any = None,
) -> ParallelAwareDataloader:
    """One data-parallel rank's fine-tuning loader; ``training`` gives the format, loss_on, overlong policy,
    columns, seq_len and seed (docs/sft.md). Rows with an images column go to the image-text loader
    (datasets/vision/loader.py), which reads the model's tower and vision tokens from ``model_args``."""
    fmt = training.dataset_format
    loss_on = training.loss_on or ("assistant" if fmt == "chat" else "completion")
    chat = chat_tokenizer(tokenizer)
    sources = load_rows(dataset_name, dataset_path)
    name = sources[0].name if len(sources) == 1 else f"{Path(sources[0].name).parent} ({len(sources)} files)"
    columns = parse_columns(training.dataset_columns)
    pad_id = tokenizer.pad_id if tokenizer.pad_id >= 0 else tokenizer.eos_id
    packing = dict(
        seq_len=training.seq_len,
        pad_id=pad_id,
        overlong=training.overlong_examples or "truncate",
        seed=training.seed or 0,
        stream_groups=stream_groups,
        num_streams=num_streams,
    )
    if fmt == "chat" and has_image_column(sources, columns):
        dataset = build_image_dataset(name, sources, chat, model_args, loss_on=loss_on, columns=columns, **packing)
    else:
        examples = tokenize_cached(sources, chat, fmt=fmt, loss_on=loss_on, columns=columns)
        dataset = SFTDataset(name, examples, **packing)
    s = dataset.stats
    logger.info(
        "fine-tuning data %s: %d %s rows (loss on %s) -> %d windows of %d tokens per epoch (%.1f steps of %d): "
        "%.1f%% real tokens (packing efficiency), %.1f%% of them trained; overlong: %d truncated, %d dropped",
        name,
        s.examples,
        fmt,
        loss_on,
        s.windows,
        training.seq_len,
        s.windows / num_streams,
        num_streams,
        100 * s.non_pad_fraction,
        100 * s.trained_tokens / max(s.tokens, 1),
        s.truncated,
        s.dropped,
    )
    return ParallelAwareDataloader(dataset)
