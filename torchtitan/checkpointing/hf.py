"""Our Llama weights <-> Hugging Face ``LlamaForCausalLM`` weights and ``config.json``.

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
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


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
    if args.get("norm_type", "rmsnorm") != "rmsnorm":
        raise ValueError(f"HF Llama uses RMSNorm; this model has norm_type = {args['norm_type']!r}")
    n_heads, n_kv_heads = _heads(args)
    out = {}
    for key, w in sd.items():
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
    return out


def hf_config(args: dict[str, Any], intermediate_size: int, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for ``LlamaForCausalLM`` from our ModelArgs (as a dict)."""
    n_heads, n_kv_heads = _heads(args)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args["dim"],
        "intermediate_size": intermediate_size,
        "num_hidden_layers": args["n_layers"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": args["dim"] // n_heads,
        "vocab_size": args["vocab_size"],
        "max_position_embeddings": args["max_seq_len"],
        "rms_norm_eps": args["norm_eps"],
        "rope_theta": args["rope_theta"],
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def model_args_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """Our ModelArgs fields (as a dict) from an HF Llama ``config.json``.

    Raises:
        NotImplementedError: features our model does not have (RoPE scaling, biases, tied embeddings).
    """
    for key, off in (("rope_scaling", None), ("attention_bias", False), ("mlp_bias", False),
                     ("tie_word_embeddings", False)):
        if config.get(key, off) not in (off, {}):
            raise NotImplementedError(f"HF config {key} = {config[key]!r}: our Llama has no such feature")
    return {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads"),
        "vocab_size": config["vocab_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-5),
        "rope_theta": config.get("rope_theta", 10000.0),
        "max_seq_len": config.get("max_position_embeddings", 2048),
        "norm_type": "rmsnorm",
    }


def export_to_hf(checkpoint_path: str, output_dir: str, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Write ``model.safetensors`` + ``config.json`` for a complete checkpoint folder; returns the config.

    ``dtype`` defaults to the checkpoint's own (an export may be bf16/fp16).
    """
    import json
    import os

    from safetensors.torch import save_file

    from torchtitan.checkpointing.manager import load_model_weights

    weights, marker = load_model_weights(checkpoint_path)
    args = _marker_args(marker, checkpoint_path)
    dtype = dtype or next(iter(weights.values())).dtype
    hf = {k: v.to(dtype) for k, v in to_hf_state_dict(weights, args).items()}
    config = hf_config(args, intermediate_size=weights["layers.0.feed_forward.w1.weight"].shape[0], dtype=dtype)
    os.makedirs(output_dir, exist_ok=True)
    save_file(hf, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return config


def import_from_hf(hf_dir: str, output_path: str) -> None:
    """HF ``model.safetensors`` + ``config.json`` -> a step-0 seed checkpoint at ``output_path``.

    A run whose checkpoint folder holds it (as ``step-0``) starts from these weights; the model
    config must match (the load checks every key and shape).
    """
    import json
    import os

    from safetensors.torch import load_file

    from torchtitan.checkpointing.manager import save_model_weights

    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        args = model_args_from_hf(json.load(f))
    weights = from_hf_state_dict(load_file(os.path.join(hf_dir, "model.safetensors")), args)
    save_model_weights(weights, output_path, {"name": "llama3", "flavor": None, "args": args, "source": hf_dir})


def _marker_args(marker: dict[str, Any], path: str) -> dict[str, Any]:
    args = (marker.get("model") or {}).get("args")
    if not args:
        raise ValueError(f"{path}: its marker records no model args; it was not written by this trainer")
    return args
