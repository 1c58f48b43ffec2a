"""Qwen3.5 ("qwen3_5") and Qwen3.5-MoE ("qwen3_5_moe") wired to the trainer: their ModelSpecs and checks.

FSDP2, HSDP, DDP, activation checkpointing, compile and pipeline parallel take the family as llama's (the blocks keep
llama's names); the MoE takes the MoE family's wiring (expert parallel, load balancing, active parameters). Tensor
parallel shards Gated DeltaNet by heads (distributed/tensor_parallel/linear_attention.py); context parallel is
refused before launch (not built: the state is not passed along the context-parallel ranks).
Not part of the pure model: this module may import ``torchtitan.spec``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchtitan.config.errors import ConfigError
from torchtitan.models.llama.spec import check_dense_config
from torchtitan.models.moe.spec import MOE_WIRING, check_moe_config, expert_bias_hf_refusal
from torchtitan.models.qwen3_5 import (
    Qwen35MoETransformer,
    Qwen35Transformer,
    qwen3_5_configs,
    qwen3_5_moe_configs,
    qwen3_5_moe_vl_configs,
    qwen3_5_vl_configs,
)
from torchtitan.models.qwen3_5.hf_adapter import QWEN3_5, QWEN3_5_MOE
from torchtitan.models.qwen3_5.hf_vl_adapter import QWEN3_5_MOE_VL, QWEN3_5_VL
from torchtitan.models.qwen3_5.multimodal import Qwen35MoEVL, Qwen35VL
from torchtitan.spec import AdapterLayout, ModelSpec, count_non_embedding_params

if TYPE_CHECKING:
    from torchtitan.config.schema import Experimental, Model, Training


def check_hybrid(args: Any, model: Model, training: Training, experimental: Experimental) -> None:
    """Both families' own checks, one line each: context parallel (not built), async TP (no plan for Gated
    DeltaNet), and Gated DeltaNet's heads split evenly over the tensor-parallel ranks."""
    named = f"model.name = {model.name!r}"
    cp, tp = experimental.context_parallel_degree, training.tensor_parallel_degree
    if cp > 1:
        raise NotImplementedError(
            f"{named} with experimental.context_parallel_degree = {cp}: not built (Gated DeltaNet's state and "
            "convolution history are not passed along the context-parallel ranks); use FSDP, HSDP, DDP, tensor or "
            "pipeline parallel (docs/models.md)"
        )
    if tp > 1 and experimental.enable_async_tensor_parallel:
        raise NotImplementedError(
            f"{named} with experimental.enable_async_tensor_parallel: the async plan has no Gated DeltaNet; turn "
            "async TP off (synchronous TP runs)"
        )
    heads = {"linear_num_key_heads": args.linear_num_key_heads, "linear_num_value_heads": args.linear_num_value_heads}
    uneven = {k: v for k, v in heads.items() if v % tp}
    if uneven:
        listed = ", ".join(f"{k} = {v}" for k, v in uneven.items())
        raise ConfigError(
            f"training.tensor_parallel_degree = {tp} does not divide {named} (flavor {model.flavor!r}) Gated "
            f"DeltaNet's {listed}: each rank holds whole heads; use a degree that divides them"
        )


def hybrid_layer_pattern(args: Any) -> tuple[int, int]:
    """The schedule repeats every ``full_attention_interval`` layers (Gated DeltaNet, then full attention): the
    estimator extrapolates over whole periods (every layer of the MoE is MoE, so its period is the same)."""
    return 0, args.full_attention_interval


def check_qwen3_5(args: Any, *, model: Model, training: Training, experimental: Experimental) -> list[str]:
    check_hybrid(args, model, training, experimental)
    return check_dense_config(args, model=model, training=training, experimental=experimental)


def check_qwen3_5_moe(args: Any, *, model: Model, training: Training, experimental: Experimental) -> list[str]:
    check_hybrid(args, model, training, experimental)
    return check_moe_config(args, model=model, training=training, experimental=experimental)


def check_vision(model: Model, training: Training) -> None:
    """The image models' own check, one line: fine-tuning data needs block_causal documents with per-sample positions
    (a packed sample's images and multimodal positions ride on its documents)."""
    named = f"model.name = {model.name!r}"
    if training.dataset_format != "text" and (
        model.attn_mask_type != "block_causal" or not model.positions_per_document
    ):
        raise ConfigError(
            f"{named} with training.dataset_format = {training.dataset_format!r} needs model.attn_mask_type = "
            "'block_causal' and model.positions_per_document = true: packed image-text samples reach the model with "
            "their documents, each sample's images and its multimodal positions from 0; set both"
        )


def _with_vision(text_check: Callable[..., list[str]]) -> Callable[..., list[str]]:
    """An image family's check: ``check_vision``, then its text family's."""

    def check(args: Any, *, model: Model, training: Training, experimental: Experimental) -> list[str]:
        check_vision(model, training)
        return text_check(args, model=model, training=training, experimental=experimental)

    return check


def _without_tower(text_count: Callable[[Any, Any], int]) -> Callable[[Any, Any], int]:
    """MFU's N per text token of an image family: its text family's count less the tower (which runs per image
    patch, not per token; MFU adds its FLOPs from each step's patches, VisionFields.image_flops)."""

    def count(args: Any, model: Any) -> int:
        return text_count(args, model) - sum(p.numel() for p in model.visual.parameters())

    return count


SPECS = {
    "qwen3_5": ModelSpec(
        "qwen3_5",
        Qwen35Transformer,
        qwen3_5_configs,
        documents=True,
        state_dict_adapter=QWEN3_5,
        adapters=AdapterLayout(QWEN3_5.block_names, ("feed_forward",), dense=True),
        check_fn=check_qwen3_5,
        layer_pattern=hybrid_layer_pattern,
        hf_model_type="qwen3_5_text",
        hf_wrapper_model_type="qwen3_5",
    ),
    "qwen3_5_moe": ModelSpec(
        "qwen3_5_moe",
        Qwen35MoETransformer,
        qwen3_5_moe_configs,
        **{**MOE_WIRING, "check_fn": check_qwen3_5_moe, "layer_pattern": hybrid_layer_pattern},
        state_dict_adapter=QWEN3_5_MOE,
        adapters=AdapterLayout(QWEN3_5_MOE.block_names, ("feed_forward.shared_expert",)),
        hf_model_type="qwen3_5_moe_text",
        hf_wrapper_model_type="qwen3_5_moe",
        hf_refusal=expert_bias_hf_refusal("qwen3_5_moe", "Qwen3.5-MoE", qwen3_5_moe_configs),
    ),
}
SPECS["qwen3_5_vl"] = ModelSpec(
    "qwen3_5_vl",
    Qwen35VL,
    qwen3_5_vl_configs,
    documents=True,
    count_flop_params=_without_tower(count_non_embedding_params),
    state_dict_adapter=QWEN3_5_VL,
    adapters=AdapterLayout(QWEN3_5.block_names, ("feed_forward",), dense=True),
    check_fn=_with_vision(check_qwen3_5),
    layer_pattern=hybrid_layer_pattern,
    hf_model_type="qwen3_5",
)
SPECS["qwen3_5_moe_vl"] = ModelSpec(
    "qwen3_5_moe_vl",
    Qwen35MoEVL,
    qwen3_5_moe_vl_configs,
    **{
        **MOE_WIRING,
        "check_fn": _with_vision(check_qwen3_5_moe),
        "layer_pattern": hybrid_layer_pattern,
        "count_flop_params": _without_tower(MOE_WIRING["count_flop_params"]),
    },
    state_dict_adapter=QWEN3_5_MOE_VL,
    adapters=AdapterLayout(QWEN3_5_MOE.block_names, ("feed_forward.shared_expert",)),
    hf_model_type="qwen3_5_moe",
    hf_refusal=expert_bias_hf_refusal("qwen3_5_moe_vl", "Qwen3.5-MoE", qwen3_5_moe_vl_configs),
)
