"""The qwen3_5 family's Hugging Face adapter: our weights <-> ``Qwen3_5ForCausalLM`` (``model_type =
"qwen3_5_text"``) and its ``config.json``.

Our blocks keep transformers' layouts: the full attention rotates halves of its first rotary dims (no row
permutation, unlike Llama's adapter), ``wq`` holds each head's query and gate side by side as ``q_proj`` does, and
Gated DeltaNet's submodules are transformers' own (``linear_attn.in_proj_qkv``, ``conv1d``, ``A_log``...), so
every weight maps by name. A published multimodal folder (``model_type = "qwen3_5"``) nests these fields under
``text_config``, which ``model_args_from_hf`` reads.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.models.common.hf_adapter import HfAdapter, base_model_args, torch_dtype_name
from torchtitan.models.qwen3_5.model import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Args

_FULL = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_LINEAR = {
    f"attention.{name}": f"linear_attn.{name}"
    for name in (
        "in_proj_qkv.weight",
        "in_proj_z.weight",
        "in_proj_b.weight",
        "in_proj_a.weight",
        "conv1d.weight",
        "dt_bias",
        "A_log",
        "norm.weight",
        "out_proj.weight",
    )
}
_COMMON = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
BUILT_LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)


class Qwen35Adapter(HfAdapter):
    hf_name = family = "Qwen3.5"
    block = {**_FULL, **_LINEAR, **_COMMON}

    def hf_config(self, args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for ``Qwen3_5ForCausalLM``."""
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "hidden_size": args["dim"],
            "intermediate_size": args["ffn_dim"],
            "num_hidden_layers": args["n_layers"],
            "num_attention_heads": args["n_heads"],
            "num_key_value_heads": args.get("n_kv_heads") or args["n_heads"],
            "head_dim": args["head_dim"],
            "vocab_size": args["vocab_size"],
            "max_position_embeddings": args["max_seq_len"],
            "rms_norm_eps": args["norm_eps"],
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": args["rope_theta"],
                "partial_rotary_factor": args["partial_rotary_factor"],
            },
            "layer_types": Qwen35Args.from_dict(args).layer_types,
            "linear_conv_kernel_dim": args["linear_conv_kernel"],
            "linear_key_head_dim": args["linear_key_head_dim"],
            "linear_value_head_dim": args["linear_value_head_dim"],
            "linear_num_key_heads": args["linear_num_key_heads"],
            "linear_num_value_heads": args["linear_num_value_heads"],
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": bool(args.get("tie_word_embeddings", False)),
            "torch_dtype": torch_dtype_name(dtype),
        }

    def model_args_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        """Our Qwen35Args fields (as a dict) from a Qwen3.5 ``config.json`` (its ``text_config`` when nested).

        Raises:
            NotImplementedError: a layer type or schedule we do not build, biases, a RoPE other than the default.
        """
        config = {**config, **config.get("text_config", {})}
        rope = {**config.get("rope_parameters", {})}
        if rope.get("rope_type", "default") != "default" or config.get("attention_bias"):
            raise NotImplementedError(
                f"HF Qwen3.5 config with rope_type {rope.get('rope_type')!r} / attention_bias "
                f"{config.get('attention_bias')!r}: our Qwen3.5 builds the default RoPE without biases"
            )
        n_layers = config["num_hidden_layers"]
        every = _full_attention_interval(config.get("layer_types"), n_layers)
        args = base_model_args(config, rope.get("rope_theta", 10_000_000.0), norm_eps=1e-6, max_len=32768)
        return {
            **args,
            "n_kv_heads": config.get("num_key_value_heads"),
            "head_dim": config.get("head_dim", 256),
            "ffn_dim": config["intermediate_size"],
            "partial_rotary_factor": rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)),
            "full_attention_interval": every,
            "linear_conv_kernel": config.get("linear_conv_kernel_dim", 4),
            "linear_key_head_dim": config.get("linear_key_head_dim", 128),
            "linear_value_head_dim": config.get("linear_value_head_dim", 128),
            "linear_num_key_heads": config.get("linear_num_key_heads", 16),
            "linear_num_value_heads": config.get("linear_num_value_heads", 32),
        }


def _full_attention_interval(layer_types: list[str] | None, n_layers: int) -> int:
    """The period of the schedule (full attention at every ``k``-th layer, Gated DeltaNet between).

    Raises:
        NotImplementedError: a layer type we do not build, or a schedule that is not that pattern (one line).
    """
    if layer_types is None:
        return 4  # transformers' default full_attention_interval
    unknown = sorted(set(layer_types) - set(BUILT_LAYER_TYPES))
    if unknown:
        raise NotImplementedError(
            f"HF Qwen3.5 config layer_types has {unknown}: our Qwen3.5 builds {' and '.join(BUILT_LAYER_TYPES)} layers"
        )
    every = layer_types.index(FULL_ATTENTION) + 1 if FULL_ATTENTION in layer_types else 0
    if not every or Qwen35Args(n_layers=n_layers, full_attention_interval=every).layer_types != list(layer_types):
        raise NotImplementedError(
            f"HF Qwen3.5 config layer_types {layer_types}: our Qwen3.5 builds full attention at every k-th layer "
            "(full_attention_interval), Gated DeltaNet between"
        )
    return every


QWEN3_5 = Qwen35Adapter()
