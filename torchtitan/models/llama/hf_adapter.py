"""The llama3 family's Hugging Face adapter: our weights <-> ``LlamaForCausalLM`` weights and ``config.json``.

Pure tensor and dict work (the spec's ``state_dict_adapter``); file I/O is ``checkpointing/hf/convert.py``'s. The
mapping itself (names, tied embeddings, q/k's RoPE row order) is the toolkit's (models/common/hf_adapter.py);
RoPE's config entries are models/common/hf_rope.py's.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.models.common.hf_adapter import HfAdapter, base_model_args, torch_dtype_name
from torchtitan.models.common.hf_rope import RopeDefaults, hf_rope_parameters, parse_hf_rope


class LlamaAdapter(HfAdapter):
    """``LlamaForCausalLM``; Qwen3's adapter extends it."""

    hf_name = "Llama"
    family = "Llama"
    block = {
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
    rope_rows = {"attention.wq.weight": "q", "attention.wk.weight": "kv"}
    rope_defaults = RopeDefaults()  # LlamaConfig's

    def to_hf_state_dict(self, sd: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Our weights -> HF's. Raises ValueError for a norm HF Llama does not have, or an unknown weight."""
        if args.get("norm_type", "rmsnorm") not in ("rmsnorm", "fused_rmsnorm"):
            raise ValueError(f"HF Llama uses RMSNorm; this model has norm_type = {args['norm_type']!r}")
        return super().to_hf_state_dict(sd, args)

    def hf_config(self, args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for ``LlamaForCausalLM`` from our ModelArgs (as a dict) and the weights (FFN width)."""
        n_heads = args["n_heads"]
        scaling = args.get("rope_scaling")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": args["dim"],
            "intermediate_size": weights["layers.0.feed_forward.w1.weight"].shape[0],
            "num_hidden_layers": args["n_layers"],
            "num_attention_heads": n_heads,
            "num_key_value_heads": args.get("n_kv_heads") or n_heads,
            "head_dim": args.get("head_dim") or args["dim"] // n_heads,
            "vocab_size": args["vocab_size"],
            "max_position_embeddings": args["max_seq_len"],
            "rms_norm_eps": args["norm_eps"],
            "rope_parameters": hf_rope_parameters(args["rope_theta"], "llama3" if scaling else "default", scaling),
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": bool(args.get("tie_word_embeddings", False)),
            "torch_dtype": torch_dtype_name(dtype),
        }

    def model_args_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        """Our ModelArgs fields (as a dict) from an HF Llama ``config.json``.

        Raises:
            NotImplementedError: features our model does not have (biases).
            ValueError: a RoPE our model does not implement (models/common/hf_rope.py).
        """
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key, False) not in (False, {}):
                raise NotImplementedError(f"HF config {key} = {config[key]!r}: our {self.family} has no such feature")
        rope = parse_hf_rope(config, family=self.family, supports=("default", "llama3"), defaults=self.rope_defaults)
        args = base_model_args(config, rope.theta, norm_eps=1e-5, max_len=2048)
        return {
            **args,
            "n_kv_heads": config.get("num_key_value_heads"),
            "rope_scaling": rope.scaling,
            **_ffn_fields(args["dim"], config.get("intermediate_size")),
        }


def _ffn_fields(dim: int, intermediate: int | None) -> dict[str, Any]:
    """``multiple_of`` / ``ffn_dim_multiplier`` that make our SwiGLU width (model.ffn_hidden_dim: 2/3 of 4*dim, times
    the multiplier, rounded up to multiple_of) exactly ``intermediate_size``: rounding any width in (0, intermediate]
    up to a multiple of intermediate gives intermediate. None: our defaults."""
    if not intermediate:
        return {}
    base = int(2 * (4 * dim) / 3)
    return {"multiple_of": intermediate, "ffn_dim_multiplier": None if base <= intermediate else intermediate / base}


ADAPTER = LlamaAdapter()
