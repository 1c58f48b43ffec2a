"""The gpt_oss family's Hugging Face adapter: our weights <-> ``GptOssForCausalLM`` weights and ``config.json``.

Names are transformers 5's, in memory and as ``save_pretrained`` writes them (bf16/fp32 checkpoints; the
published MXFP4 ``*_blocks``/``*_scales`` experts are not read: dequantize first). Per layer i:

* ``self_attn.{q,k,v,o}_proj.{weight,bias}`` <-> ``attention.w{q,k,v,o}``; RoPE: HF rotates halves of each
  head and we rotate interleaved pairs, so wq/wk rows *and biases* are reordered within each head (llama's).
* ``self_attn.sinks`` (n_heads,) <-> ``attention.sinks``.
* ``mlp.router.{weight,bias}`` <-> ``feed_forward.router.gate.{weight,bias}``.
* ``mlp.experts.gate_up_proj`` (E, dim, 2 * hidden), gate in the even columns and up in the odd ones, <->
  ``experts.w1`` / ``w3`` (E, hidden, dim); ``gate_up_proj_bias`` (E, 2 * hidden) <-> ``b1`` / ``b3``;
  ``down_proj`` (E, hidden, dim) <-> ``w2`` (E, dim, hidden); ``down_proj_bias`` (E, dim) <-> ``b2``.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.models.common.hf_adapter import HfAdapter, base_model_args, torch_dtype_name
from torchtitan.models.common.hf_rope import RopeDefaults, hf_rope_parameters, parse_hf_rope
from torchtitan.models.gpt_oss.args import LAYER_KINDS, aux_loss_coeff_from_hf, aux_loss_coeff_to_hf

# GptOssConfig's: no RoPE entry means the published YaRN
_ROPE_DEFAULTS = RopeDefaults(
    theta=150000.0,
    max_position_embeddings=131072,
    parameters={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
)
# HF fused tensor -> (our gate part, our up part); gate in the even columns, up in the odd ones
_FUSED = {
    "mlp.experts.gate_up_proj": ("feed_forward.experts.w1", "feed_forward.experts.w3"),
    "mlp.experts.gate_up_proj_bias": ("feed_forward.experts.b1", "feed_forward.experts.b3"),
}
_DOWN = ("feed_forward.experts.w2", "mlp.experts.down_proj")


class GptOssAdapter(HfAdapter):
    hf_name = "GptOss"
    # the weights that only change their name
    block = {f"attention.w{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")}
    block |= {
        "attention.sinks": "self_attn.sinks",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "feed_forward.router.gate.weight": "mlp.router.weight",
        "feed_forward.router.gate.bias": "mlp.router.bias",
        "feed_forward.experts.b2": "mlp.experts.down_proj_bias",
    }
    rope_rows = {f"attention.w{p}.{kind}": h for p, h in (("q", "q"), ("k", "kv")) for kind in ("weight", "bias")}
    unknown_hint = (
        "; a quantized (MXFP4) checkpoint must be dequantized to bf16 first (transformers: "
        "Mxfp4Config(dequantize=True), then save_pretrained)"
    )

    def extra_to_hf(self, suffix: str, w: torch.Tensor, layer: str, sd, args) -> dict[str, torch.Tensor] | None:
        """The experts' fused gate/up and transposed down projections; an aux-loss-free bias has none (the
        spec refuses its export first)."""
        fused = {ours: hf for hf, pair in _FUSED.items() for ours in pair}
        if suffix == _DOWN[0]:
            return {_DOWN[1]: w.transpose(1, 2).contiguous()}  # (E, dim, hidden) -> (E, hidden, dim)
        if suffix == "feed_forward.expert_bias":
            return {}
        if suffix not in fused:
            return None
        hf = fused[suffix]
        if suffix != _FUSED[hf][0]:
            return {}  # the pair's first weight interleaves both
        gate, up = (sd[f"layers.{layer}.{s}"] for s in _FUSED[hf])
        gate, up = (t.transpose(1, 2) if t.dim() == 3 else t for t in (gate, up))  # (E, [dim,] hidden)
        return {hf: torch.stack([gate, up], dim=-1).flatten(-2).contiguous()}  # (E, [dim,] 2*hidden)

    def extra_from_hf(self, suffix: str, w: torch.Tensor, args: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        if suffix == _DOWN[1]:
            return {_DOWN[0]: w.transpose(1, 2).contiguous()}
        if suffix not in _FUSED:
            return None
        gate, up = w[..., ::2], w[..., 1::2]  # (E, [dim,] hidden) each
        return {
            name: (t.transpose(1, 2) if t.dim() == 3 else t).contiguous() for name, t in zip(_FUSED[suffix], (gate, up))
        }

    def hf_config(self, args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for ``GptOssForCausalLM`` from our GptOssArgs (as a dict)."""
        n_layers, every = args["n_layers"], args["full_attention_every"]
        yarn = args.get("yarn")
        # the context YaRN extends to (131072 published): transformers warns unless it is factor * original
        context = args["max_seq_len"] if yarn is None else int(yarn["factor"] * yarn["original_max_seq_len"])
        return {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "hidden_size": args["dim"],
            "intermediate_size": args["moe_hidden_dim"],
            "num_hidden_layers": n_layers,
            "num_attention_heads": args["n_heads"],
            "num_key_value_heads": args.get("n_kv_heads") or args["n_heads"],
            "head_dim": args["head_dim"],
            "vocab_size": args["vocab_size"],
            "max_position_embeddings": context,
            "rms_norm_eps": args["norm_eps"],
            "rope_parameters": hf_rope_parameters(args["rope_theta"], "yarn" if yarn else "default", yarn),
            "sliding_window": args["sliding_window"],
            "layer_types": [LAYER_KINDS[(i + 1) % every == 0] for i in range(n_layers)],
            "num_local_experts": args["num_experts"],
            "num_experts_per_tok": args["top_k"],
            "router_aux_loss_coef": aux_loss_coeff_to_hf(args["aux_loss_coeff"], args["top_k"], n_layers),
            "output_router_logits": False,
            "swiglu_alpha": args["swiglu_alpha"],
            "swiglu_limit": args["swiglu_limit"],
            "attention_bias": True,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "tie_word_embeddings": bool(args.get("tie_word_embeddings", False)),
            "torch_dtype": torch_dtype_name(dtype),
        }

    def model_args_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        """Our GptOssArgs fields (as a dict) from an HF GptOss ``config.json`` (published or transformers 5's).

        Raises:
            NotImplementedError: what our model does not have (no attention bias, a layer_types list that is not
                "full every N-th layer").
            ValueError: a RoPE our model does not implement (models/common/hf_rope.py).
        """
        if not config.get("attention_bias", True):
            raise NotImplementedError("HF config attention_bias = false: our gpt-oss attention always has biases")
        n_layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
        rope = parse_hf_rope(config, family="gpt-oss", supports=("default", "yarn"), defaults=_ROPE_DEFAULTS)
        return {
            **base_model_args(config, rope.theta, norm_eps=1e-5, max_len=131072),
            "n_kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
            "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            "yarn": rope.scaling,
            "num_experts": config.get("num_local_experts") or config["num_experts"],
            "top_k": top_k,
            "moe_hidden_dim": config["intermediate_size"],
            "sliding_window": config.get("sliding_window") or 1,
            "full_attention_every": _full_attention_every(
                config.get("layer_types"), n_layers, config.get("sliding_window")
            ),
            "swiglu_alpha": config.get("swiglu_alpha", 1.702),
            "swiglu_limit": config.get("swiglu_limit", 7.0),
            "aux_loss_coeff": aux_loss_coeff_from_hf(config.get("router_aux_loss_coef", 0.001), top_k, n_layers),
        }


def _full_attention_every(layer_types: list[str] | None, n_layers: int, window: int | None) -> int:
    """Our period from HF's ``layer_types`` (default: sliding, full, sliding, ...; no window: all full)."""
    if window is None:
        return 1
    if layer_types is None:
        return 2
    for every in range(1, n_layers + 1):
        if layer_types == [LAYER_KINDS[(i + 1) % every == 0] for i in range(n_layers)]:
            return every
    raise NotImplementedError(
        f"HF config layer_types = {layer_types}: our gpt-oss attends fully on every N-th layer and within the "
        "sliding window on the others"
    )


ADAPTER = GptOssAdapter()
