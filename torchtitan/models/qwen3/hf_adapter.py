"""The qwen3 and qwen3_moe families' Hugging Face adapters: ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``.

Qwen3 is Llama's layout plus per-head q/k RMSNorm weights: they act on the same head_dim before RoPE, so
their weights get the same within-head reordering as wq/wk's rows (one "head" each). Qwen3-MoE adds the
router (``mlp.gate``) and routed experts, stacked here and one tensor per expert in HF files
(``mlp.experts.{e}.gate_proj.weight``; transformers >= 5 fuses them in memory and writes this layout).
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.models.common.hf_adapter import StackedExperts
from torchtitan.models.common.hf_rope import RopeDefaults
from torchtitan.models.llama.hf_adapter import LlamaAdapter


class Qwen3Adapter(LlamaAdapter):
    hf_name = family = "Qwen3"
    block = {
        **LlamaAdapter.block,
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    }
    rope_rows = {**LlamaAdapter.rope_rows, "attention.q_norm.weight": "one", "attention.k_norm.weight": "one"}
    rope_defaults = RopeDefaults(max_position_embeddings=32768)  # Qwen3Config's (and Qwen3MoeConfig's)

    def hf_config(self, args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for ``Qwen3ForCausalLM``."""
        config = super().hf_config(args, weights, dtype)
        config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=args["head_dim"])
        config.update(use_sliding_window=False, sliding_window=None)
        config.pop("mlp_bias")
        return config

    def model_args_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        """Our Qwen3Args fields (as a dict) from an HF Qwen3 ``config.json``.

        Raises:
            NotImplementedError: features our model does not have (sliding-window attention, biases).
            ValueError: a RoPE our model does not implement.
        """
        if config.get("use_sliding_window"):
            raise NotImplementedError("HF config use_sliding_window = true: our Qwen3 attends to the whole context")
        args = super().model_args_from_hf(config)
        args.update(head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        args.update(ffn_dim=config["intermediate_size"])
        return args


class Qwen3MoeAdapter(Qwen3Adapter):
    hf_name = family = "Qwen3-MoE"
    block = {**Qwen3Adapter.block, "feed_forward.router.gate.weight": "mlp.gate.weight"}
    experts = StackedExperts()

    def hf_config(self, args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for ``Qwen3MoeForCausalLM`` (every layer MoE)."""
        config = super().hf_config(args, {"layers.0.feed_forward.w1.weight": torch.empty(args["ffn_dim"], 0)}, dtype)
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
        config.update(
            num_experts=args["num_experts"],
            num_experts_per_tok=args["top_k"],
            moe_intermediate_size=args["moe_hidden_dim"],
            norm_topk_prob=args["route_norm"],
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=args["aux_loss_coeff"],
            output_router_logits=False,
        )
        return config

    def model_args_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        """Our Qwen3MoEArgs fields (as a dict) from an HF Qwen3-MoE ``config.json``.

        Raises:
            NotImplementedError: dense layers among the MoE ones (``mlp_only_layers``, ``decoder_sparse_step``).
        """
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            raise NotImplementedError(
                "HF config mlp_only_layers / decoder_sparse_step: our Qwen3-MoE has every layer MoE; got "
                f"mlp_only_layers = {config.get('mlp_only_layers')}, "
                f"decoder_sparse_step = {config.get('decoder_sparse_step')}"
            )
        args = super().model_args_from_hf(config)
        args.update(
            num_experts=config.get("num_experts") or config["num_local_experts"],  # published | transformers >= 5
            top_k=config["num_experts_per_tok"],
            moe_hidden_dim=config["moe_intermediate_size"],
            route_norm=bool(config.get("norm_topk_prob", False)),
            aux_loss_coeff=config.get("router_aux_loss_coef", 0.001),
        )
        return args


QWEN3 = Qwen3Adapter()
QWEN3_MOE = Qwen3MoeAdapter()
