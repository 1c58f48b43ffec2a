"""The deepseek_v3 family's Hugging Face adapter: our weights <-> ``DeepseekV3ForCausalLM`` weights and ``config.json``.

Names map one to one (``_BLOCK``), with no reordering: our RoPE rotates interleaved pairs, the layout
of DeepSeek's weights and transformers' ``rope_interleave = True`` (its default, and every published
DeepSeek-V3 / Kimi K2 checkpoint's; ``rope_interleave = false`` is refused). Routed experts are stacked here
(``feed_forward.experts.w1`` (E, hidden, dim) holds every expert's gate_proj, ``w3`` the up_proj,
``w2`` the down_proj) and per expert in HF files (``mlp.experts.{e}.gate_proj.weight``).
``e_score_correction_bias`` is our ``expert_bias`` (zeros where our flavor balances without it).
Layers past ``n_layers`` (DeepSeek-V3's multi-token-prediction layer 61) are not built and are skipped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from torchtitan.models.common.rope.yarn import HF_YARN_KEYS, YarnScaling

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight",
}
# the same map, public: LoRA's target names and PEFT keys (torchtitan/lora/names.py) are read from it
BLOCK_NAMES = _BLOCK
_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Our whole-model weights -> HF names. ``args``: our DeepSeekV3Args as a dict.

    Raises:
        ValueError: a key we do not know how to map.
    """
    out = {}
    for key, w in sd.items():
        if key == "output.weight" and args.get("tie_word_embeddings"):
            continue  # the embedding table; HF's tie_word_embeddings shares it
        if key in _TOP:
            out[_TOP[key]] = w.contiguous()
            continue
        _, layer, suffix = key.split(".", 2) if key.startswith("layers.") else ("", "", key)
        if suffix.startswith("feed_forward.experts.") and suffix.rsplit(".", 1)[1] in _EXPERTS:
            name = _EXPERTS[suffix.rsplit(".", 1)[1]]
            for e in range(w.shape[0]):
                out[f"model.layers.{layer}.mlp.experts.{e}.{name}.weight"] = w[e].contiguous()
        elif layer and suffix in _BLOCK:
            out[f"model.layers.{layer}.{_BLOCK[suffix]}"] = w.contiguous()
        else:
            raise ValueError(f"no Hugging Face name for weight {key!r}")
    for layer in range(args["first_k_dense"], args["n_layers"]):
        router = f"model.layers.{layer}.mlp.gate.weight"
        bias = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        if router in out and bias not in out:  # a flavor balanced without the bias: HF's is zeros
            out[bias] = torch.zeros(args["num_experts"], dtype=torch.float32)
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF DeepSeek-V3 weights (all or some layers) -> ours (the inverse of ``to_hf_state_dict``).

    Raises:
        ValueError: a weight we do not know, or a layer missing some of its experts.
    """
    top, block = {v: k for k, v in _TOP.items()}, {v: k for k, v in _BLOCK.items()}
    by_hf = {v: k for k, v in _EXPERTS.items()}
    out, experts = {}, {}
    for key, w in hf.items():
        parts = key.split(".", 3)  # model, layers, i, suffix
        if key in top:
            out[top[key]] = w.contiguous()
        elif len(parts) == 4 and parts[:2] == ["model", "layers"] and int(parts[2]) >= args["n_layers"]:
            continue  # a multi-token-prediction layer (DeepSeek-V3's layer 61): not built here
        elif len(parts) == 4 and parts[3] in block:
            out[f"layers.{parts[2]}.{block[parts[3]]}"] = w.contiguous()
        elif len(parts) == 4 and _expert_key(parts[3]) is not None:
            e, name = _expert_key(parts[3])
            experts.setdefault((parts[2], by_hf[name]), {})[e] = w
        elif not key.endswith("rotary_emb.inv_freq"):  # a cache older HF versions saved
            raise ValueError(f"unknown Hugging Face DeepSeek-V3 weight {key!r}")
    for (layer, ours), per_expert in experts.items():
        if sorted(per_expert) != list(range(args["num_experts"])):
            raise ValueError(f"layer {layer}: expected experts 0..{args['num_experts'] - 1}, got {sorted(per_expert)}")
        out[f"layers.{layer}.feed_forward.experts.{ours}"] = torch.stack([per_expert[e] for e in sorted(per_expert)])
    if args.get("tie_word_embeddings") and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _expert_key(suffix: str) -> tuple[int, str] | None:
    """``mlp.experts.{e}.{gate_proj|up_proj|down_proj}.weight`` -> (e, projection); None for other keys."""
    parts = suffix.split(".")
    if len(parts) == 5 and parts[:2] == ["mlp", "experts"] and parts[2].isdigit() and parts[3] in _EXPERTS.values():
        return int(parts[2]), parts[3]
    return None


def hf_config(args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for ``DeepseekV3ForCausalLM`` from our DeepSeekV3Args (as a dict)."""
    yarn = args.get("rope_scaling")
    rope_parameters = {"rope_type": "default", "rope_theta": args["rope_theta"]}
    if yarn is not None:
        rope_parameters.update(_hf_yarn(yarn), rope_type="yarn")
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": args["dim"],
        "num_hidden_layers": args["n_layers"],
        "num_attention_heads": args["n_heads"],
        "num_key_value_heads": args["n_heads"],
        "vocab_size": args["vocab_size"],
        "rms_norm_eps": args["norm_eps"],
        "intermediate_size": args["ffn_dim"],
        "q_lora_rank": args["q_lora_rank"] or None,
        "kv_lora_rank": args["kv_lora_rank"],
        "qk_nope_head_dim": args["qk_nope_head_dim"],
        "qk_rope_head_dim": args["qk_rope_head_dim"],
        "v_head_dim": args["v_head_dim"],
        "n_routed_experts": args["num_experts"],
        "num_experts_per_tok": args["top_k"],
        "moe_intermediate_size": args["moe_hidden_dim"],
        "n_shared_experts": args["shared_expert_multiplier"] if args["num_shared_experts"] else 0,
        "n_group": args["num_expert_groups"],
        "topk_group": args["top_k_groups"],
        "norm_topk_prob": args["route_norm"],
        "routed_scaling_factor": args["route_scale"],
        "first_k_dense_replace": args["first_k_dense"],
        # YaRN's stretched context, as published (transformers warns when it is not factor * original)
        "max_position_embeddings": int(yarn["factor"] * yarn["original_max_seq_len"]) if yarn else args["max_seq_len"],
        "rope_parameters": rope_parameters,
        "rope_interleave": True,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": bool(args.get("tie_word_embeddings", False)),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _hf_yarn(ours: dict[str, Any]) -> dict[str, Any]:
    return {hf: ours[our] for hf, our in HF_YARN_KEYS.items() if ours.get(our) is not None}


def model_args_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """Our DeepSeekV3Args fields (as a dict) from an HF DeepSeek-V3 ``config.json`` (published or transformers 5).

    As transformers' DeepseekV3 does, routing is sigmoid with the correction bias whatever
    ``scoring_func`` / ``topk_method`` say, and every layer from ``first_k_dense_replace`` on is MoE;
    an absent key takes transformers' DeepseekV3Config default.

    Raises:
        NotImplementedError: features our model does not have (biases, other activations or RoPE types,
            RoPE weights in halves).
    """
    for key, expected in (("attention_bias", False), ("hidden_act", "silu"), ("rope_interleave", True)):
        if config.get(key, expected) != expected:
            raise NotImplementedError(
                f"HF config {key} = {config[key]!r}: our DeepSeek-V3 implements {expected!r} only"
            )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    n_shared = config.get("n_shared_experts", 1) or 0
    return {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "vocab_size": config["vocab_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        "rope_scaling": _our_yarn(rope, config),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "max_seq_len": config.get("max_position_embeddings", 4096),
        "norm_type": "rmsnorm",
        "ffn_dim": config["intermediate_size"],
        "q_lora_rank": config.get("q_lora_rank", 1536) or 0,  # null: no q compression
        "kv_lora_rank": config["kv_lora_rank"],
        "qk_nope_head_dim": config["qk_nope_head_dim"],
        "qk_rope_head_dim": config["qk_rope_head_dim"],
        "v_head_dim": config["v_head_dim"],
        "num_experts": config.get("n_routed_experts") or config["num_local_experts"],
        "top_k": config["num_experts_per_tok"],
        "moe_hidden_dim": config["moe_intermediate_size"],
        "num_shared_experts": 1 if n_shared else 0,
        "shared_expert_multiplier": n_shared or 1,
        "num_expert_groups": config.get("n_group", 8),
        "top_k_groups": config.get("topk_group", 4),
        "route_norm": bool(config.get("norm_topk_prob", True)),
        "route_scale": float(config.get("routed_scaling_factor", 2.5)),
        "first_k_dense": config.get("first_k_dense_replace", 3),
        "moe_every": 1,
        "score_func": "sigmoid",
        "load_balance": "bias",
    }


def _our_yarn(rope: dict[str, Any], config: dict[str, Any]) -> dict[str, Any] | None:
    """HF ``rope_parameters`` / ``rope_scaling`` -> our YarnScaling (as a dict); None for plain RoPE.

    Raises:
        NotImplementedError: a RoPE type other than default / yarn.
    """
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise NotImplementedError(f"HF config rope type {kind!r}: our DeepSeek-V3 implements 'default' and 'yarn' RoPE")
    original = rope.get("original_max_position_embeddings") or config["max_position_embeddings"]
    ours = {our: rope[hf] for hf, our in HF_YARN_KEYS.items() if rope.get(hf) is not None}  # absent: the default
    # no factor: transformers stretches max_position_embeddings / original_max_position_embeddings
    factor = rope.get("factor") or config["max_position_embeddings"] / original
    return dataclasses.asdict(YarnScaling(**{**ours, "factor": float(factor), "original_max_seq_len": original}))
