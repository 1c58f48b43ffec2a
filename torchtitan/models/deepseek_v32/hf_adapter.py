"""The deepseek_v32 family's Hugging Face adapter: DeepSeek-V3's (deepseek_v3/hf_adapter.py) plus the indexer's
weights (``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}``, the same names under our ``attention.indexer``) and
its ``config.json`` keys (``index_n_heads``, ``index_head_dim``, ``index_topk``) for ``DeepseekV32ForCausalLM``.

Multi-token prediction (``mtp_layers``) is DeepSeek-V3's layout with DSA blocks: depth k+1 is the published layer
``n_layers + k``, its indexer under ``self_attn.indexer`` as every layer's (DeepSeek-V3.2-Exp's checkpoint ships
one such layer and ``num_nextn_predict_layers`` = 1; transformers builds none and ignores it on load).

The training stage and the indexer loss's weight are ours alone (HF's model is the sparse forward): an import
trains the sparse stage unless ``model.dsa_stage`` says otherwise, and an export does not record them.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.models.deepseek_v3.hf_adapter import DeepSeekV3Adapter

INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


class DeepSeekV32Adapter(DeepSeekV3Adapter):
    hf_name = "DeepSeek-V3.2"
    block = {
        **DeepSeekV3Adapter.block,
        **{f"attention.indexer.{name}": f"self_attn.indexer.{name}" for name in INDEXER},
    }

    def hf_config(self, args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for ``DeepseekV32ForCausalLM`` from our DeepSeekV32Args (as a dict)."""
        config = super().hf_config(args, weights, dtype)
        config.pop("rope_interleave")  # DeepseekV32Config has no such key (RoPE on pairs is its only layout)
        if not args.get("mtp_layers", 0):  # nor this one; the published config.json has it, with the MTP layer
            config.pop("num_nextn_predict_layers")
        return {
            **config,
            "architectures": ["DeepseekV32ForCausalLM"],
            "model_type": "deepseek_v32",
            "index_n_heads": args["index_n_heads"],
            "index_head_dim": args["index_head_dim"],
            "index_topk": args["index_topk"],
        }

    def model_args_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        """Our DeepSeekV32Args fields (as a dict) from an HF DeepSeek-V3.2 ``config.json``.

        Raises:
            NotImplementedError: no q bottleneck (DeepseekV32's attention and indexer read it), or an
                ``mlp_layer_types`` other than dense layers then MoE ones; as DeepSeek-V3's import for the rest.
        """
        if not config.get("q_lora_rank", 1536):
            raise NotImplementedError(
                f"HF config q_lora_rank = {config['q_lora_rank']!r}: DeepSeek-V3.2's attention and indexer read the q "
                "bottleneck's latent; give q_lora_rank a positive rank"
            )
        first_dense = config.get("first_k_dense_replace", 3)
        n_layers = config["num_hidden_layers"]
        expected = ["dense"] * min(first_dense, n_layers) + ["sparse"] * max(n_layers - first_dense, 0)
        if config.get("mlp_layer_types") not in (None, expected):
            raise NotImplementedError(
                f"HF config mlp_layer_types = {config['mlp_layer_types']!r}: our DeepSeek-V3.2 builds "
                f"first_k_dense_replace = {first_dense} dense layers then MoE ones; write that pattern ({expected})"
            )
        return {
            # DeepseekV32Config's defaults where they differ from DeepseekV3Config's; it has no rope_interleave (pairs)
            **super().model_args_from_hf({"n_group": 1, **config, "rope_interleave": True}),
            "index_n_heads": config.get("index_n_heads", 64),
            "index_head_dim": config.get("index_head_dim", 128),
            "index_topk": config.get("index_topk", 2048),
        }


ADAPTER = DeepSeekV32Adapter()
