"""The deepseek_v4 family's Hugging Face adapter: our weights <-> ``DeepseekV4ForCausalLM``'s and ``config.json``.

Names are transformers 5's, in memory and as ``save_pretrained`` writes them (bf16/fp32; the published FP8/FP4
checkpoints with DeepSeek's own names are not read: load them with transformers and save_pretrained first). Both
models rotate interleaved pairs, so no row is permuted. Per layer i, besides the one-to-one ``block`` names:

* ``mlp.experts.gate_up_proj`` (E, 2 * hidden, dim) <-> ``feed_forward.experts.w1`` (gate) and ``w3`` (up) stacked
  along dim 1; ``mlp.experts.down_proj`` (E, dim, hidden) <-> ``w2``;
* ``mlp.gate.e_score_correction_bias`` <-> ``feed_forward.expert_bias`` (top-k layers; zeros where a flavor
  balances otherwise), ``mlp.gate.tid2eid`` <-> ``feed_forward.tid2eid`` (hash layers).

Outside the layers: ``model.hc_head.hc_{fn,base,scale}`` <-> ``hc_head.{fn,base,scale}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchtitan.models.common.hf_adapter import HfAdapter, torch_dtype_name
from torchtitan.models.deepseek_v4.args import (
    ATTENTION_KINDS,
    CSA,
    HCA,
    MOE,
    default_layer_types,
    default_mlp_layer_types,
)

_HEAD = {f"hc_head.{p}": f"model.hc_head.hc_{p}" for p in ("fn", "base", "scale")}
_RATIO_KINDS = {0: ATTENTION_KINDS[0], 4: CSA, 128: HCA}  # transformers' legacy per-layer ``compress_ratios``


def _compressor(ours: str, hf: str) -> dict[str, str]:
    return {
        f"{ours}.wkv.weight": f"{hf}.kv_proj.weight",
        f"{ours}.wgate.weight": f"{hf}.gate_proj.weight",
        f"{ours}.ape": f"{hf}.position_bias",
        f"{ours}.norm.weight": f"{hf}.kv_norm.weight",
    }


class DeepSeekV4Adapter(HfAdapter):
    hf_name = "DeepseekV4"
    block = {
        "attention.wq_a.weight": "self_attn.q_a_proj.weight",
        "attention.q_norm.weight": "self_attn.q_a_norm.weight",
        "attention.wq_b.weight": "self_attn.q_b_proj.weight",
        "attention.wkv.weight": "self_attn.kv_proj.weight",
        "attention.kv_norm.weight": "self_attn.kv_norm.weight",
        "attention.wo_a.weight": "self_attn.o_a_proj.weight",
        "attention.wo_b.weight": "self_attn.o_b_proj.weight",
        "attention.sinks": "self_attn.sinks",
        **_compressor("attention.compressor", "self_attn.compressor"),
        **_compressor("attention.indexer.compressor", "self_attn.compressor.indexer"),
        "attention.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
        "attention.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        **{f"{hc}.{p}": f"{hc}.{p}" for hc in ("attn_hc", "ffn_hc") for p in ("fn", "base", "scale")},
        "feed_forward.router.gate.weight": "mlp.gate.weight",
        "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
        "feed_forward.tid2eid": "mlp.gate.tid2eid",
        "feed_forward.shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
        "feed_forward.shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight",
        "feed_forward.shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight",
    }
    unknown_hint = (
        "; a checkpoint with DeepSeek's own names or FP8/FP4 experts must be loaded by transformers and saved with "
        "save_pretrained first"
    )

    def to_hf_state_dict(self, sd: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        head = {_HEAD[k]: w.contiguous() for k, w in sd.items() if k in _HEAD}
        return head | super().to_hf_state_dict({k: w for k, w in sd.items() if k not in _HEAD}, args)

    def from_hf_state_dict(self, hf: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        hf = _saved_to_memory_names(hf)
        by_hf = {v: k for k, v in _HEAD.items()}
        head = {by_hf[k]: w.contiguous() for k, w in hf.items() if k in by_hf}
        return head | super().from_hf_state_dict({k: w for k, w in hf.items() if k not in by_hf}, args)

    def extra_to_hf(self, suffix: str, w: torch.Tensor, layer: str, sd, args) -> dict[str, torch.Tensor] | None:
        if suffix == "feed_forward.experts.w1":
            up = sd[f"layers.{layer}.feed_forward.experts.w3"]
            return {"mlp.experts.gate_up_proj": torch.cat([w, up], dim=1).contiguous()}  # (E, 2 * hidden, dim)
        if suffix == "feed_forward.experts.w3":
            return {}  # in w1's gate_up_proj
        if suffix == "feed_forward.experts.w2":
            return {"mlp.experts.down_proj": w.contiguous()}
        return None

    def extra_from_hf(self, suffix: str, w: torch.Tensor, args: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        if suffix == "mlp.experts.gate_up_proj":
            gate, up = w.chunk(2, dim=1)
            return {"feed_forward.experts.w1": gate.contiguous(), "feed_forward.experts.w3": up.contiguous()}
        if suffix == "mlp.experts.down_proj":
            return {"feed_forward.experts.w2": w.contiguous()}
        return None

    def finish_to_hf(self, out: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        """transformers keeps a selection bias on every top-k layer: zeros where our flavor has none."""
        for i, kind in enumerate(args["mlp_layer_types"]):
            gate = f"model.layers.{i}.mlp.gate.weight"
            bias = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
            if kind == MOE and gate in out and bias not in out:
                out[bias] = torch.zeros(args["num_experts"], dtype=torch.float32)
        return out

    def hf_config(self, args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for ``DeepseekV4ForCausalLM`` from our DeepSeekV4Args (as a dict)."""
        factor = args["rope_dim"] / args["head_dim"]
        compress = {"rope_type": "default", "rope_theta": args["compress_rope_theta"], "partial_rotary_factor": factor}
        yarn = args.get("compress_yarn")
        if yarn is not None:
            compress |= {
                "rope_type": "yarn",
                "factor": yarn["factor"],
                "original_max_position_embeddings": yarn["original_max_seq_len"],
                "beta_fast": yarn["beta_fast"],
                "beta_slow": yarn["beta_slow"],
                "truncate": yarn["truncate"],
                "attention_factor": 1.0 if yarn["attention_factor"] is None else yarn["attention_factor"],
            }
        return {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": args["vocab_size"],
            "hidden_size": args["dim"],
            "moe_intermediate_size": args["moe_hidden_dim"],
            "num_hidden_layers": args["n_layers"],
            "num_attention_heads": args["n_heads"],
            "num_key_value_heads": 1,
            "head_dim": args["head_dim"],
            "q_lora_rank": args["q_lora_rank"],
            "num_experts_per_tok": args["top_k"],
            "n_routed_experts": args["num_experts"],
            "n_shared_experts": 1,
            "scoring_func": args["score_func"],
            "norm_topk_prob": True,
            "routed_scaling_factor": args["route_scale"],
            "max_position_embeddings": args["max_seq_len"],
            "rope_theta": args["rope_theta"],
            "compress_rope_theta": args["compress_rope_theta"],
            "partial_rotary_factor": factor,
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": args["rope_theta"], "partial_rotary_factor": factor},
                "compress": compress,
            },
            "layer_types": list(args["layer_types"]),
            "mlp_layer_types": list(args["mlp_layer_types"]),
            "compress_rates": {CSA: args["csa_rate"], HCA: args["hca_rate"]},
            "hc_mult": args["hc_mult"],
            "hc_sinkhorn_iters": args["hc_sinkhorn_iters"],
            "hc_eps": args["hc_eps"],
            "swiglu_limit": args["swiglu_limit"],
            "sliding_window": args["sliding_window"],
            "o_groups": args["o_groups"],
            "o_lora_rank": args["o_lora_rank"],
            "index_n_heads": args["index_n_heads"],
            "index_head_dim": args["index_head_dim"],
            "index_topk": args["index_topk"],
            "num_nextn_predict_layers": 0,
            "rms_norm_eps": args["norm_eps"],
            "tie_word_embeddings": bool(args.get("tie_word_embeddings", False)),
            "torch_dtype": torch_dtype_name(dtype),
        }

    def model_args_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        """Our DeepSeekV4Args fields (as a dict) from a ``DeepseekV4Config`` config.json, its legacy keys folded in as
        transformers folds them (``compress_ratios``, ``compress_rate_csa/hca``, ``num_hash_layers``,
        ``qk_rope_head_dim``).

        Raises:
            NotImplementedError: a RoPE our model does not compute (a scaled sliding RoPE; a compressed one other
                than plain or YaRN).
        """
        n, head_dim = config["num_hidden_layers"], config.get("head_dim", 512)
        rates = {CSA: 4, HCA: 128, **(config.get("compress_rates") or {})}
        rates[CSA] = config.get("compress_rate_csa", rates[CSA])
        rates[HCA] = config.get("compress_rate_hca", rates[HCA])
        layer_types = config.get("layer_types")
        if layer_types is None and config.get("compress_ratios") is not None:
            layer_types = [_RATIO_KINDS[r] for r in config["compress_ratios"]]
        mlp_types = config.get("mlp_layer_types") or default_mlp_layer_types(n, config.get("num_hash_layers", 3))
        rope_factor = config.get("partial_rotary_factor") or (config.get("qk_rope_head_dim", 64) / head_dim)
        main, compress = _rope_parameters(config, rope_factor)
        return {
            "dim": config["hidden_size"],
            "n_layers": n,
            "n_heads": config["num_attention_heads"],
            "vocab_size": config["vocab_size"],
            "norm_eps": config.get("rms_norm_eps", 1e-6),
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
            "max_seq_len": config.get("max_position_embeddings", 1048576),
            "norm_type": "rmsnorm",
            "head_dim": head_dim,
            "rope_dim": int(head_dim * rope_factor),
            "q_lora_rank": config.get("q_lora_rank", 1024),
            "rope_theta": main["rope_theta"],
            "compress_rope_theta": compress["rope_theta"],
            "compress_yarn": _yarn(compress),
            "layer_types": tuple((layer_types or default_layer_types(n))[:n]),
            "mlp_layer_types": tuple(mlp_types[:n]),
            "csa_rate": rates[CSA],
            "hca_rate": rates[HCA],
            "sliding_window": config.get("sliding_window", 128),
            "hc_mult": config.get("hc_mult", 4),
            "hc_sinkhorn_iters": config.get("hc_sinkhorn_iters", 20),
            "hc_eps": config.get("hc_eps", 1e-6),
            "swiglu_limit": config.get("swiglu_limit", 10.0),
            "o_groups": config.get("o_groups", 8),
            "o_lora_rank": config.get("o_lora_rank", 1024),
            "index_n_heads": config.get("index_n_heads", 64),
            "index_head_dim": config.get("index_head_dim", 128),
            "index_topk": config.get("index_topk", 512),
            "num_experts": config.get("n_routed_experts", 256),
            "top_k": config.get("num_experts_per_tok", 6),
            "moe_hidden_dim": config.get("moe_intermediate_size", 2048),
            "score_func": config.get("scoring_func", "sqrtsoftplus"),
            "route_scale": config.get("routed_scaling_factor", 1.5),
            "load_balance": "bias",
        }


def _rope_parameters(config: Mapping[str, Any], factor: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(main, compress) RoPE parameters as ``DeepseekV4Config.__post_init__`` builds them."""
    rp = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return rp["main"], rp["compress"]
    main = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    compress = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    compress = {"rope_type": "default", **compress, "rope_theta": config.get("compress_rope_theta", 160000.0)}
    if compress.get("type") and "rope_type" not in rp:
        compress["rope_type"] = compress["type"]
    return main, compress


def _yarn(compress: Mapping[str, Any]) -> dict[str, Any] | None:
    """Our compress_yarn (YarnScaling's fields) from the compressed RoPE's parameters."""
    kind = compress.get("rope_type", "default")
    if kind == "default":
        return None
    if kind != "yarn":
        raise NotImplementedError(
            f"HF config rope_parameters['compress']['rope_type'] = {kind!r}: our DeepSeek-V4 computes the compressed "
            "layers' RoPE plain or with YaRN; convert a checkpoint with one of those"
        )
    return {
        "factor": compress["factor"],
        "original_max_seq_len": compress["original_max_position_embeddings"],
        "beta_fast": compress.get("beta_fast") or 32.0,
        "beta_slow": compress.get("beta_slow") or 1.0,
        "truncate": compress.get("truncate", True),
        "attention_factor": compress.get("attention_factor", 1.0),  # transformers forces 1.0 when unset
    }


# Our block suffix -> the name transformers' save_pretrained writes (it reverses its conversion mapping: DeepSeek's
# own names, which ours follow), where it differs from ours.
_SAVED = {
    "attention.kv_norm.weight": "attn.norm.weight",
    "attention.compressor.norm.weight": "attn.compressor.norm.weight",
    "attention.indexer.compressor.norm.weight": "attn.indexer.compressor.norm.weight",
    "attention.sinks": "attn.attn_sink",
    "attention_norm.weight": "attn_norm.weight",
    **{f"{hc}_hc.{p}": f"hc_{hc}_{p}" for hc in ("attn", "ffn") for p in ("fn", "base", "scale")},
    "feed_forward.router.gate.weight": "ffn.gate.weight",
    "feed_forward.expert_bias": "ffn.gate.bias",
    "feed_forward.tid2eid": "ffn.gate.tid2eid",
    **{f"feed_forward.shared_expert.w{i}.weight": f"ffn.shared_experts.w{i}.weight" for i in (1, 2, 3)},
}


def _saved_name(ours: str) -> str:
    if ours in _SAVED:
        return _SAVED[ours]
    return "attn." + ours.removeprefix("attention.") if ours.startswith("attention.") else ours


_SAVED_TO_MEMORY = {_saved_name(ours): hf for ours, hf in DeepSeekV4Adapter.block.items()}


def _saved_to_memory_names(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A folder's weights as transformers' save_pretrained writes them (``head.weight``, ``layers.{i}.attn.wq_a``,
    per-expert ``ffn.experts.{e}.w1``) -> the names its model holds in memory (ours map to those); weights already
    under those names pass through."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, w in hf.items():
        if key == "head.weight":
            out["lm_head.weight"] = w
            continue
        parts = key.split(".", 3)  # model, layers, i, suffix
        suffix = parts[3] if len(parts) == 4 and parts[:2] == ["model", "layers"] else None
        expert = suffix.split(".") if suffix is not None and suffix.startswith("ffn.experts.") else None
        if expert is not None and len(expert) == 5 and expert[2].isdigit():
            experts.setdefault((parts[2], expert[3]), {})[int(expert[2])] = w
        elif suffix in _SAVED_TO_MEMORY:
            out[f"model.layers.{parts[2]}.{_SAVED_TO_MEMORY[suffix]}"] = w
        else:
            out[key] = w
    for (layer, name), per_expert in sorted(experts.items()):
        stacked = torch.stack([per_expert[e] for e in sorted(per_expert)])  # (E, out, in)
        out[f"model.layers.{layer}.mlp.experts.{name}"] = stacked
    for layer in {layer for layer, _ in experts}:
        w1, w3 = (out.pop(f"model.layers.{layer}.mlp.experts.{n}") for n in ("w1", "w3"))
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = out.pop(f"model.layers.{layer}.mlp.experts.w2")
    return out


ADAPTER = DeepSeekV4Adapter()
