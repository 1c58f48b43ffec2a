"""Pre-launch checks of the attention keys: ``model.attn_mask_type``, ``positions_per_document`` and
``attention_backend`` (docs/attention.md), against the layout and the model family. Light: the
preflight runs them; the masks themselves are models/common/documents.py and features/documents/feed.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan.config.errors import ConfigError
from torchtitan.spec import get_model_spec, model_names

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims


def check_attention(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Raise on attention settings that cannot run as asked; return warnings for ones with no effect."""
    m, exp = config.model, config.experimental
    if m.attn_mask_type == "causal":
        if m.positions_per_document:
            raise ConfigError(
                "model.positions_per_document = true restarts RoPE positions at every document, which only "
                "block_causal attention keeps apart; set model.attn_mask_type = 'block_causal' or "
                "positions_per_document = false"
            )
        if m.attention_backend != "auto":
            return [
                f"model.attention_backend = {m.attention_backend!r} has no effect with model.attn_mask_type = "
                "'causal' (causal attention always runs SDPA)"
            ]
        return []
    if not get_model_spec(m.name).documents:
        raise NotImplementedError(
            f"model.attn_mask_type = 'block_causal' with model.name = {m.name!r}: this family's blocks take no "
            "document ids (ModelSpec.documents is false); use attn_mask_type = 'causal' or a family that "
            f"supports it ({', '.join(n for n in model_names() if get_model_spec(n).documents)})"
        )
    if dims.cp_enabled and exp.context_parallel_impl == "torch":
        raise NotImplementedError(
            "model.attn_mask_type = 'block_causal' with experimental.context_parallel_impl = 'torch': torch's "
            "context parallel has no document mask; use context_parallel_impl = 'portable' (our ring attention "
            "skips the blocks the documents mask out)"
        )
    if m.attention_backend != "auto" and dims.cp_enabled:
        return [
            f"model.attention_backend = {m.attention_backend!r} has no effect under context parallel: "
            "the ring attention computes the document mask itself"
        ]
    return []


def check_attention_device(config: JobConfig, dims: ParallelDims, device_type: str) -> list[str]:
    """On ``device_type``: FlexAttention trains on CUDA only."""
    m = config.model
    if m.attn_mask_type == "block_causal" and m.attention_backend == "flex":
        if device_type != "cuda":
            raise NotImplementedError(
                "model.attention_backend = 'flex' needs CUDA: torch 2.13 has no FlexAttention backward on CPU; "
                "use 'sdpa' or 'auto' (auto picks sdpa here)"
            )
    return []
