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

import dataclasses
from typing import Any

import torch

from torchtitan.models.gpt_oss.args import LAYER_KINDS, aux_loss_coeff_from_hf, aux_loss_coeff_to_hf
from torchtitan.models.llama.hf_adapter import _halves_to_interleaved, _interleaved_to_halves
from torchtitan.models.common.rope.yarn import HF_YARN_KEYS, YarnScaling

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_TOP["output.weight"] = "lm_head.weight"
# our suffix -> HF suffix, per layer: the weights that only change their name
_BLOCK = {f"attention.w{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")}
_BLOCK |= {
    "attention.sinks": "self_attn.sinks",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.router.gate.weight": "mlp.router.weight",
    "feed_forward.router.gate.bias": "mlp.router.bias",
    "feed_forward.experts.b2": "mlp.experts.down_proj_bias",
}
_ROPE = {"attention.wq.weight", "attention.wq.bias", "attention.wk.weight", "attention.wk.bias"}
# HF fused tensor -> (our gate part, our up part); gate in the even columns, up in the odd ones
_FUSED = {
    "mlp.experts.gate_up_proj": ("feed_forward.experts.w1", "feed_forward.experts.w3"),
    "mlp.experts.gate_up_proj_bias": ("feed_forward.experts.b1", "feed_forward.experts.b3"),
}
_DOWN = ("feed_forward.experts.w2", "mlp.experts.down_proj")


def _heads(args: dict[str, Any], suffix: str) -> int:
    return args["n_heads"] if ".wq." in suffix else args.get("n_kv_heads") or args["n_heads"]


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Our weights (whole model, or some layers) -> HF names and layouts. ``args``: our GptOssArgs as a dict.

    Raises:
        ValueError: a key we do not know how to map.
    """
    out, fused = {}, {ours: hf for hf, pair in _FUSED.items() for ours in pair}
    for key, w in sd.items():
        if key in _TOP:
            if not (key == "output.weight" and args.get("tie_word_embeddings")):  # tied: HF shares the table
                out[_TOP[key]] = w.contiguous()
            continue
        _, layer, suffix = key.split(".", 2) if key.startswith("layers.") else (None, None, key)
        prefix = f"model.layers.{layer}."
        if suffix in _BLOCK:
            w = _interleaved_to_halves(w, _heads(args, suffix)) if suffix in _ROPE else w
            out[prefix + _BLOCK[suffix]] = w.contiguous()
        elif suffix == _DOWN[0]:
            out[prefix + _DOWN[1]] = w.transpose(1, 2).contiguous()  # (E, dim, hidden) -> (E, hidden, dim)
        elif suffix in fused:
            hf = fused[suffix]
            if prefix + hf not in out:  # the pair's first weight interleaves both
                gate, up = (sd[f"layers.{layer}.{s}"] for s in _FUSED[hf])
                gate, up = (t.transpose(1, 2) if t.dim() == 3 else t for t in (gate, up))  # (E, [dim,] hidden)
                out[prefix + hf] = torch.stack([gate, up], dim=-1).flatten(-2).contiguous()  # (E, [dim,] 2*hidden)
        elif suffix != "feed_forward.expert_bias":  # an aux-loss-free bias is refused before export (spec)
            raise ValueError(f"no Hugging Face name for weight {key!r}")
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF GptOss weights (whole model, or one layer's) -> ours (the inverse of ``to_hf_state_dict``).

    Raises:
        ValueError: an HF weight we do not know (e.g. the MXFP4 ``*_blocks`` of a quantized checkpoint).
    """
    top, block = {v: k for k, v in _TOP.items()}, {v: k for k, v in _BLOCK.items()}
    out = {}
    for key, w in hf.items():
        if key in top:
            out[top[key]] = w.contiguous()
            continue
        parts = key.split(".", 3)  # model, layers, i, suffix
        if len(parts) != 4 or parts[:2] != ["model", "layers"]:
            raise ValueError(f"unknown Hugging Face GptOss weight {key!r}")
        prefix, suffix = f"layers.{parts[2]}.", parts[3]
        if suffix in block:
            ours = block[suffix]
            out[prefix + ours] = (_halves_to_interleaved(w, _heads(args, ours)) if ours in _ROPE else w).contiguous()
        elif suffix == _DOWN[1]:
            out[prefix + _DOWN[0]] = w.transpose(1, 2).contiguous()
        elif suffix in _FUSED:
            gate, up = w[..., ::2], w[..., 1::2]  # (E, [dim,] hidden) each
            for name, t in zip(_FUSED[suffix], (gate, up)):
                out[prefix + name] = (t.transpose(1, 2) if t.dim() == 3 else t).contiguous()
        else:
            raise ValueError(
                f"unknown Hugging Face GptOss weight {key!r}; a quantized (MXFP4) checkpoint must be "
                "dequantized to bf16 first (transformers: Mxfp4Config(dequantize=True), then save_pretrained)"
            )
    if args.get("tie_word_embeddings") and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config(args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for ``GptOssForCausalLM`` from our GptOssArgs (as a dict)."""
    n_layers, every = args["n_layers"], args["full_attention_every"]
    yarn = args.get("yarn")
    rope = None if yarn is None else {"rope_type": "yarn", **_hf_yarn(yarn)}
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
        "rope_theta": args["rope_theta"],
        "rope_scaling": rope,
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
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# the YarnScaling fields gpt-oss's config.json always states; the others are written only when given
_YARN_PUBLISHED = ("factor", "original_max_seq_len", "beta_fast", "beta_slow", "truncate")


def _hf_yarn(ours: dict[str, Any]) -> dict[str, Any]:
    """Our YarnScaling (as a dict; one saved before mscale existed lacks those keys) -> HF's yarn keys."""
    return {hf: ours[our] for hf, our in HF_YARN_KEYS.items() if our in _YARN_PUBLISHED or ours.get(our)}


def model_args_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """Our GptOssArgs fields (as a dict) from an HF GptOss ``config.json`` (published or transformers 5's).

    Raises:
        NotImplementedError: what our model does not have (no attention bias, other RoPE types or YaRN
            options, a layer_types list that is not "full every N-th layer").
        ValueError: a yarn entry without its factor.
    """
    if not config.get("attention_bias", True):
        raise NotImplementedError("HF config attention_bias = false: our gpt-oss attention always has biases")
    n_layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    return {
        "dim": config["hidden_size"],
        "n_layers": n_layers,
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
        "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        "vocab_size": config["vocab_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-5),
        "rope_theta": (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 150000.0)),
        "yarn": _our_yarn(config),
        "max_seq_len": config.get("max_position_embeddings", 131072),
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
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "norm_type": "rmsnorm",
    }


def _our_yarn(config: dict[str, Any]) -> dict[str, Any] | None:
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    unknown = sorted(k for k in rope if k not in (*HF_YARN_KEYS, "rope_type", "type", "rope_theta"))
    if kind != "yarn" or unknown:
        raise NotImplementedError(
            f"HF config rope type {kind!r} with keys {unknown or 'as yarn'}: our gpt-oss implements default RoPE and "
            f"YaRN with {', '.join(HF_YARN_KEYS)} only"
        )
    if rope.get("factor") is None:
        raise ValueError(f"HF config rope_scaling {rope} has no 'factor': transformers' yarn needs one; add it")
    yarn = {ours: rope[hf] for hf, ours in HF_YARN_KEYS.items() if rope.get(hf) is not None}  # absent: the default
    return dataclasses.asdict(YarnScaling(**yarn))


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
