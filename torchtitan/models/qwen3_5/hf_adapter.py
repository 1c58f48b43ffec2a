"""The qwen3_5 family's Hugging Face adapter: our weights <-> ``Qwen3_5ForCausalLM`` (``model_type =
"qwen3_5_text"``) and its ``config.json``.

Our blocks keep transformers' layouts but one: the full attention rotates halves of its first rotary dims (no row
permutation, unlike Llama's adapter), ``wq`` holds each head's query and gate side by side as ``q_proj`` does, and
Gated DeltaNet's submodules are transformers' own (``linear_attn.in_proj_qkv``, ``conv1d``, ``A_log``...), so
every weight maps by name. The one: our ``in_proj_qkv`` rows and ``conv1d`` channels are grouped by key head
(query, key, its values: tensor parallel shards whole groups), transformers' are all queries, all keys, all
values; the adapter reorders them both ways (a LoRA B of ``in_proj_qkv`` too, as it maps through here). A published multimodal folder (``model_type = "qwen3_5"`` / ``"qwen3_5_moe"``) nests
these fields under ``text_config``, which ``model_args_from_hf`` reads, and its language model's weights under
``model.language_model.``, read as the text model's; its vision tower (``model.visual.``) and multi-token
prediction layer (``mtp.``) are not part of the text model and are not read (transformers' text class skips them
too). Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``, ``"qwen3_5_moe_text"``) adds the router, the routed experts (one
tensor per expert in HF files, as Qwen3-MoE) and the gated shared expert.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.models.common.hf_adapter import HfAdapter, StackedExperts, base_model_args, torch_dtype_name
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
_GROUPED = ("attention.in_proj_qkv.weight", "attention.conv1d.weight")  # rows grouped by key head in ours


def grouped_to_hf(w: torch.Tensor, args: dict[str, Any], *, to_hf: bool) -> torch.Tensor:
    """Rows (or channels) of Gated DeltaNet's fused q/k/v: ours grouped by key head [q_h k_h v_h]... <-> HF's
    [q... k... v...] (``to_hf``); trailing dims kept."""
    heads, dk = args["linear_num_key_heads"], args["linear_key_head_dim"]
    values = args["linear_num_value_heads"] * args["linear_value_head_dim"] // heads  # one group's value rows
    rows = w.reshape(w.shape[0], -1)
    if to_hf:
        q, k, v = rows.view(heads, 2 * dk + values, -1).split((dk, dk, values), dim=1)
        out = torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)])
    else:
        q, k, v = rows.split((heads * dk, heads * dk, heads * values))
        out = torch.cat([q.view(heads, dk, -1), k.view(heads, dk, -1), v.view(heads, values, -1)], dim=1)
    return out.reshape(w.shape)


_MULTIMODAL_TEXT, _NOT_TEXT = "model.language_model.", ("model.visual.", "mtp.")


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
                "mrope_section": list(args.get("mrope_section", (11, 11, 10))),
                "mrope_interleaved": True,
            },
            "layer_types": Qwen35Args(
                n_layers=args["n_layers"], full_attention_interval=args["full_attention_interval"]
            ).layer_types,
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

    def _permute(self, w: torch.Tensor, ours: str, args: dict[str, Any], *, to_hf: bool) -> torch.Tensor:
        return grouped_to_hf(w, args, to_hf=to_hf) if ours in _GROUPED else w

    def from_hf_state_dict(self, hf: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        """A text folder's weights, or a multimodal folder's language model (its tower and MTP layer not read)."""
        text = {
            "model." + key.removeprefix(_MULTIMODAL_TEXT) if key.startswith(_MULTIMODAL_TEXT) else key: w
            for key, w in hf.items()
            if not key.startswith(_NOT_TEXT)
        }
        return super().from_hf_state_dict(text, args)

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
            "mrope_section": tuple(rope.get("mrope_section", (11, 11, 10))),
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


class Qwen35MoeAdapter(Qwen35Adapter):
    hf_name = family = "Qwen3.5-MoE"
    block = {
        **_FULL,
        **_LINEAR,
        **{k: v for k, v in _COMMON.items() if not k.startswith("feed_forward.")},
        "feed_forward.router.gate.weight": "mlp.gate.weight",
        "feed_forward.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
        "feed_forward.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
        "feed_forward.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
        "feed_forward.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
    }
    experts = StackedExperts()

    def hf_config(self, args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for ``Qwen3_5MoeForCausalLM`` (every layer MoE, no dense width)."""
        config = super().hf_config({**args, "ffn_dim": 0}, weights, dtype)
        config.pop("intermediate_size")
        config.update(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text")
        config.update(
            num_experts=args["num_experts"],
            num_experts_per_tok=args["top_k"],
            moe_intermediate_size=args["moe_hidden_dim"],
            shared_expert_intermediate_size=args["moe_hidden_dim"] * args.get("shared_expert_multiplier", 1),
            router_aux_loss_coef=args["aux_loss_coeff"],
            output_router_logits=False,
        )
        return config

    def model_args_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        """Our Qwen35MoEArgs fields (as a dict) from a Qwen3.5-MoE ``config.json``.

        Raises:
            NotImplementedError: a shared expert whose width is not a multiple of the routed experts' (ours is
                ``moe_hidden_dim * shared_expert_multiplier``), and the dense model's refusals.
        """
        text = {**config, **config.get("text_config", {})}
        width, shared = text["moe_intermediate_size"], text.get("shared_expert_intermediate_size", 0)
        if not shared or shared % width:
            raise NotImplementedError(
                f"HF Qwen3.5-MoE config shared_expert_intermediate_size = {shared} with moe_intermediate_size = "
                f"{width}: our Qwen3.5-MoE builds one shared expert whose width is a multiple of the routed experts'"
            )
        args = super().model_args_from_hf({**text, "intermediate_size": 0})
        args.pop("ffn_dim")
        return {
            **args,
            "num_experts": text["num_experts"],
            "top_k": text["num_experts_per_tok"],
            "moe_hidden_dim": width,
            "shared_expert_multiplier": shared // width,
            "aux_loss_coeff": text.get("router_aux_loss_coef", 0.001),
        }


QWEN3_5 = Qwen35Adapter()
QWEN3_5_MOE = Qwen35MoeAdapter()
