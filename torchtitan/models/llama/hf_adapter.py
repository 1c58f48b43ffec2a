"""The llama3 family's Hugging Face adapter: our weights <-> ``LlamaForCausalLM`` weights and ``config.json``.

Pure tensor and dict work (the spec's ``state_dict_adapter``); file I/O is ``checkpointing/hf.py``'s.

RoPE: our ``apply_rotary_emb`` rotates interleaved pairs (x[2i], x[2i+1]) of each head; HF Llama
rotates halves (x[i], x[i + head_dim/2]) ("rotate_half"). Attention scores only need q and k
permuted the same way, so exporting reorders the rows of wq/wk within each head: HF row i takes
our row 2i, HF row i + head_dim/2 takes our row 2i+1. Importing inverts it. v/o are untouched.
"""

from __future__ import annotations

from typing import Any

import torch

# our suffix -> HF suffix, per block
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# the same map, public: LoRA's target names and PEFT keys (torchtitan/lora/names.py) are read from it
BLOCK_NAMES = _BLOCK
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows (heads * head_dim, dim): per head, pairs (2i, 2i+1) -> (i, i + head_dim/2)."""
    head_dim = w.shape[0] // n_heads
    return w.view(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    head_dim = w.shape[0] // n_heads
    return w.view(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def _heads(args: dict[str, Any]) -> tuple[int, int]:
    return args["n_heads"], args.get("n_kv_heads") or args["n_heads"]


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Our whole-model weights -> HF names and RoPE layout. ``args``: our ModelArgs as a dict.

    Raises:
        ValueError: a key we do not know how to map, or a norm HF Llama does not have.
    """
    if args.get("norm_type", "rmsnorm") not in ("rmsnorm", "fused_rmsnorm"):
        raise ValueError(f"HF Llama uses RMSNorm; this model has norm_type = {args['norm_type']!r}")
    n_heads, n_kv_heads = _heads(args)
    out = {}
    for key, w in sd.items():
        if key == "output.weight" and args.get("tie_word_embeddings"):
            continue  # the embedding table; HF's tie_word_embeddings shares it
        if key in _TOP:
            out[_TOP[key]] = w.contiguous()
            continue
        prefix, layer, suffix = key.split(".", 2) if key.startswith("layers.") else (None, None, key)
        if prefix is None or suffix not in _BLOCK:
            raise ValueError(f"no Hugging Face name for weight {key!r}")
        if suffix == "attention.wq.weight":
            w = _interleaved_to_halves(w, n_heads)
        elif suffix == "attention.wk.weight":
            w = _interleaved_to_halves(w, n_kv_heads)
        out[f"model.layers.{layer}.{_BLOCK[suffix]}"] = w.contiguous()
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF Llama weights -> our names and RoPE layout (the inverse of ``to_hf_state_dict``)."""
    n_heads, n_kv_heads = _heads(args)
    top = {v: k for k, v in _TOP.items()}
    block = {v: k for k, v in _BLOCK.items()}
    out = {}
    for key, w in hf.items():
        if key in top:
            out[top[key]] = w.contiguous()
            continue
        parts = key.split(".", 3)  # model, layers, i, suffix
        if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in block:
            if key.endswith("rotary_emb.inv_freq"):
                continue  # a cache older HF versions saved; ours is recomputed
            raise ValueError(f"unknown Hugging Face Llama weight {key!r}")
        suffix = block[parts[3]]
        if suffix == "attention.wq.weight":
            w = _halves_to_interleaved(w, n_heads)
        elif suffix == "attention.wk.weight":
            w = _halves_to_interleaved(w, n_kv_heads)
        out[f"layers.{parts[2]}.{suffix}"] = w.contiguous()
    if args.get("tie_word_embeddings") and "tok_embeddings.weight" in out:
        # one tensor under both names, as the tied model's state dict holds it (a partial dict, e.g.
        # one layer's weights during a sharded load, has no embedding)
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config(args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for ``LlamaForCausalLM`` from our ModelArgs (as a dict) and the weights (FFN width)."""
    n_heads, n_kv_heads = _heads(args)
    intermediate_size = weights["layers.0.feed_forward.w1.weight"].shape[0]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args["dim"],
        "intermediate_size": intermediate_size,
        "num_hidden_layers": args["n_layers"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": args.get("head_dim") or args["dim"] // n_heads,
        "vocab_size": args["vocab_size"],
        "max_position_embeddings": args["max_seq_len"],
        "rms_norm_eps": args["norm_eps"],
        "rope_theta": args["rope_theta"],
        "rope_scaling": _hf_rope_scaling(args.get("rope_scaling")),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": bool(args.get("tie_word_embeddings", False)),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def model_args_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """Our ModelArgs fields (as a dict) from an HF Llama ``config.json``.

    Raises:
        NotImplementedError: features our model does not have (other RoPE types, biases).
    """
    for key, off in (
        ("attention_bias", False),
        ("mlp_bias", False),
    ):
        if config.get(key, off) not in (off, {}):
            raise NotImplementedError(f"HF config {key} = {config[key]!r}: our Llama has no such feature")
    return {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads"),
        "vocab_size": config["vocab_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-5),
        "rope_theta": (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0)),
        "rope_scaling": _our_rope_scaling(config),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "max_seq_len": config.get("max_position_embeddings", 2048),
        "norm_type": "rmsnorm",
    }


# HF's llama3 rope-scaling keys -> our RopeScaling fields
_ROPE_KEYS = {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_max_seq_len",
}


def _hf_rope_scaling(ours: dict[str, Any] | None) -> dict[str, Any] | None:
    """Our RopeScaling (as a dict) -> the published Llama 3.1 ``rope_scaling`` entry."""
    if ours is None:
        return None
    return {"rope_type": "llama3", **{hf: ours[our] for hf, our in _ROPE_KEYS.items()}}


def _our_rope_scaling(config: dict[str, Any]) -> dict[str, Any] | None:
    """``rope_scaling`` (config.json as published) or ``rope_parameters`` (transformers >= 5) -> ours.

    Raises:
        NotImplementedError: a RoPE type other than default / llama3 (e.g. yarn, linear, dynamic).
    """
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise NotImplementedError(f"HF config rope type {kind!r}: our Llama implements 'default' and 'llama3' RoPE")
    return {our: rope[hf] for hf, our in _ROPE_KEYS.items()}
