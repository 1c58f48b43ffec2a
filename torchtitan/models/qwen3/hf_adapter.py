"""The qwen3 family's Hugging Face adapter: our weights <-> ``Qwen3ForCausalLM`` weights and ``config.json``.

Qwen3 is Llama's layout plus per-head q/k RMSNorm weights, so llama's adapter does the rest. RoPE:
as for Llama, HF rotates halves of each head and we rotate interleaved pairs; the q/k norms act on
the same head_dim before RoPE, so their weights get the same within-head reordering as wq/wk's rows.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.models.llama import hf_adapter as llama

BLOCK_NAMES = llama.BLOCK_NAMES  # the linears are llama's (LoRA's names: torchtitan/lora/names.py)
_NORMS = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
    norms = {k: v for k, v in sd.items() if k.split(".", 2)[-1] in _NORMS}
    out = llama.to_hf_state_dict({k: v for k, v in sd.items() if k not in norms}, args)
    for key, w in norms.items():
        _, layer, suffix = key.split(".", 2)
        out[f"model.layers.{layer}.{_NORMS[suffix]}"] = llama._interleaved_to_halves(w, 1).contiguous()
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
    ours = {v: k for k, v in _NORMS.items()}
    norms = {k: v for k, v in hf.items() if k.split(".", 3)[-1] in ours}
    out = llama.from_hf_state_dict({k: v for k, v in hf.items() if k not in norms}, args)
    for key, w in norms.items():
        _, _, layer, suffix = key.split(".", 3)
        out[f"layers.{layer}.{ours[suffix]}"] = llama._halves_to_interleaved(w, 1).contiguous()
    return out


def hf_config(args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for ``Qwen3ForCausalLM``."""
    config = llama.hf_config(args, weights, dtype)
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=args["head_dim"])
    config.update(use_sliding_window=False, sliding_window=None)
    config.pop("mlp_bias")
    return config


def model_args_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """Our Qwen3Args fields (as a dict) from an HF Qwen3 ``config.json``.

    Raises:
        NotImplementedError: features our model does not have (sliding-window attention, biases, RoPE types).
    """
    if config.get("use_sliding_window"):
        raise NotImplementedError("HF config use_sliding_window = true: our Qwen3 attends to the whole context")
    args = llama.model_args_from_hf(config)
    args.update(head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    args.update(ffn_dim=config["intermediate_size"])
    return args
