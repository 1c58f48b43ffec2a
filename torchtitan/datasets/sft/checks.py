"""Pre-launch check of the fine-tuning keys (``training.dataset_format`` and the keys that go with it).
Light: nothing of the data stack is imported."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from torchtitan.datasets.sft.columns import parse_columns

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

SFT_KEYS = ("loss_on", "overlong_examples", "dataset_columns")


def check_fine_tuning(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Fine-tuning keys only with fine-tuning data; fine-tuning data only with the masking that keeps packed
    examples apart; ``loss_on`` fits the format; the column map parses."""
    t, m = config.training, config.model
    if t.dataset_format == "text":
        given = [f"training.{k} = {getattr(t, k)!r}" for k in SFT_KEYS if getattr(t, k) is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} applies to fine-tuning data, but training.dataset_format = 'text' (pre-training "
                "documents, every token trained); set dataset_format = 'chat' or 'prompt_completion', or unset it"
            )
        return []
    fmt = f"training.dataset_format = '{t.dataset_format}'"
    if m.attn_mask_type != "block_causal" or not m.positions_per_document:
        raise ValueError(
            f"{fmt} packs several examples into each window; without model.attn_mask_type = 'block_causal' and "
            f"model.positions_per_document = true (got {m.attn_mask_type!r}, {m.positions_per_document}) tokens would "
            "attend across examples and positions would not restart at each one; set both"
        )
    if t.dataset_format == "chat" and t.loss_on == "completion":
        raise ValueError(
            f"training.loss_on = 'completion' is for prompt_completion data; with {fmt} use 'assistant' (the "
            "assistant turns) or 'all'"
        )
    path = m.tokenizer_path
    if not (path.endswith("tokenizer.json") or os.path.isfile(os.path.join(path, "tokenizer.json"))):
        raise ValueError(
            f"{fmt} renders rows with the tokenizer's chat template: model.tokenizer_path must be a Hugging Face "
            f"tokenizer (tokenizer.json and tokenizer_config.json, or their folder), got '{path}'"
        )
    parse_columns(t.dataset_columns)
    return []
