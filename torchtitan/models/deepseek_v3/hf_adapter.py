"""The deepseek_v3 family's Hugging Face adapter: our weights <-> ``DeepseekV3ForCausalLM`` weights and ``config.json``.

Names map one to one (``_BLOCK``), with no reordering: our RoPE rotates interleaved pairs, the layout
of DeepSeek's weights and transformers' ``rope_interleave = True`` (its default, and every published
DeepSeek-V3 / Kimi K2 checkpoint's; ``rope_interleave = false`` is refused). Routed experts are stacked here
(``feed_forward.experts.w1`` (E, hidden, dim) holds every expert's gate_proj, ``w3`` the up_proj,
``w2`` the down_proj) and per expert in HF files (``mlp.experts.{e}.gate_proj.weight``).
``e_score_correction_bias`` is our ``expert_bias`` (zeros where our flavor balances without it).
Multi-token prediction (``mtp_layers``, models/common/mtp.py): depth k+1 is the published layer ``n_layers + k``
(DeepSeek-V3's 61): its block under the block's names, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, and
copies of the embedding and the head (``embed_tokens``, ``shared_head.head``), which are not read (ours are the
model's own; a folder whose copies differ from them is refused) and are written from the model's on export. Layers
past ``n_layers + mtp_layers`` are skipped.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.models.common.hf_adapter import HfAdapter, StackedExperts, base_model_args, torch_dtype_name
from torchtitan.models.common.hf_rope import RopeDefaults, hf_rope_parameters, parse_hf_rope
from torchtitan.models.common.mtp import MTP_OWN, MTP_SHARED, layers_as_mtp, mtp_as_layers


class DeepSeekV3Adapter(HfAdapter):
    hf_name = "DeepSeek-V3"
    block = {
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
    experts = StackedExperts()
    skip_layers_past_n = True

    def to_hf_state_dict(self, sd: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        return super().to_hf_state_dict(mtp_as_layers(sd, args["n_layers"]), args)

    def from_hf_state_dict(self, hf: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The base mapping over the model's layers and its MTP depths (``mtp_layers``), the depths renamed ours.

        Raises:
            ValueError: an MTP layer's embedding or head copy that differs from the model's (both in ``hf``).
        """
        n_layers, depths = args["n_layers"], args.get("mtp_layers", 0)
        for k in range(depths):
            for suffix, main in MTP_SHARED.items():
                key = f"model.layers.{n_layers + k}.{suffix}"
                if key in hf and main in hf and not torch.equal(hf[key], hf[main]):
                    raise ValueError(
                        f"Hugging Face {self.hf_name} weight {key!r} differs from {main!r}: our multi-token "
                        "prediction shares the model's; allowed: equal copies (as published); fix: train with "
                        "model.mtp_layers = 0, or copy the model's tensor into the layer"
                    )
        out = super().from_hf_state_dict(hf, {**args, "n_layers": n_layers + depths})
        return layers_as_mtp(out, n_layers)

    def extra_to_hf(self, suffix: str, w: torch.Tensor, layer: str, sd, args) -> dict[str, torch.Tensor] | None:
        """An MTP depth's own weights (``enorm``, ``hnorm``, ``eh_proj``, ``norm``) -> the published names."""
        return {MTP_OWN[suffix]: w.contiguous()} if int(layer) >= args["n_layers"] and suffix in MTP_OWN else None

    def extra_from_hf(self, suffix: str, w: torch.Tensor, args: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """An MTP layer's own weights -> ours; its embedding and head copies are known and not read (``{}``)."""
        by_hf = {v: k for k, v in MTP_OWN.items()}
        if suffix in by_hf:
            return {by_hf[suffix]: w.contiguous()}
        return {} if suffix in MTP_SHARED else None

    def finish_to_hf(self, out: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        depths = args.get("mtp_layers", 0)
        for k in range(depths):  # the published copies of the shared embedding and head (own storage: safetensors)
            for suffix, main in MTP_SHARED.items():
                if main in out:
                    out[f"model.layers.{args['n_layers'] + k}.{suffix}"] = out[main].clone()
        for layer in range(args["first_k_dense"], args["n_layers"] + depths):
            router = f"model.layers.{layer}.mlp.gate.weight"
            bias = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
            if router in out and bias not in out:  # a flavor balanced without the bias: HF's is zeros
                out[bias] = torch.zeros(args["num_experts"], dtype=torch.float32)
        return out

    def hf_config(self, args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for ``DeepseekV3ForCausalLM`` from our DeepSeekV3Args (as a dict)."""
        yarn = args.get("rope_scaling")
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
            "max_position_embeddings": int(yarn["factor"] * yarn["original_max_seq_len"])
            if yarn
            else args["max_seq_len"],
            "rope_parameters": hf_rope_parameters(args["rope_theta"], "yarn" if yarn else "default", yarn),
            "rope_interleave": True,
            "num_nextn_predict_layers": args.get("mtp_layers", 0),
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": bool(args.get("tie_word_embeddings", False)),
            "torch_dtype": torch_dtype_name(dtype),
        }

    def model_args_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        """Our DeepSeekV3Args fields (as a dict) from an HF DeepSeek-V3 ``config.json`` (published or transformers 5).

        As transformers' DeepseekV3 does, routing is sigmoid with the correction bias whatever
        ``scoring_func`` / ``topk_method`` say, and every layer from ``first_k_dense_replace`` on is MoE;
        an absent key takes transformers' DeepseekV3Config default.

        Raises:
            NotImplementedError: features our model does not have (biases, other activations, RoPE weights in
                halves).
            ValueError: a RoPE our model does not implement (models/common/hf_rope.py).
        """
        for key, expected in (("attention_bias", False), ("hidden_act", "silu"), ("rope_interleave", True)):
            if config.get(key, expected) != expected:
                raise NotImplementedError(
                    f"HF config {key} = {config[key]!r}: our DeepSeek-V3 implements {expected!r} only"
                )
        rope = parse_hf_rope(
            config,
            family="DeepSeek-V3",
            supports=("default", "yarn"),
            defaults=RopeDefaults(max_position_embeddings=4096),
        )
        n_shared = config.get("n_shared_experts", 1) or 0
        return {
            **base_model_args(config, rope.theta, norm_eps=1e-6, max_len=4096),
            "rope_scaling": rope.scaling,
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
            "mtp_layers": config.get("num_nextn_predict_layers", 0),
        }


ADAPTER = DeepSeekV3Adapter()
