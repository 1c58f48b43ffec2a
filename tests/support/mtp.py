"""A tiny Hugging Face DeepSeek-V3 folder with one multi-token-prediction layer in the published layout.

transformers builds no MTP layer (``DeepseekV3ForCausalLM`` ignores ``model.layers.61.*`` on load and writes
``num_nextn_predict_layers`` = 1 by default without one), so the folder is transformers' own save of the model,
plus the MTP layer's weights added under DeepSeek-V3's names: ``model.layers.{N}`` (N = num_hidden_layers) holds a
decoder layer's weights (those of layer N of a transformers model one layer deeper, an MoE layer), ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the embedding and head (``embed_tokens``,
``shared_head.head``), as the published checkpoint stores them.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

# debugmodel_tiny's shapes (models/deepseek_v3/__init__.py) in transformers' spelling, at a vocabulary of ``vocab``
TINY = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 2048,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
}


def write_mtp_folder(folder: str, vocab: int = 256, seed: int = 0) -> str:
    """Save the folder (random init, std 0.02 as transformers'); returns it."""
    import transformers

    torch.manual_seed(seed)
    config = {**TINY, "vocab_size": vocab}
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config))
    model.save_pretrained(folder)
    n = config["num_hidden_layers"]
    deeper = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**config, "num_hidden_layers": n + 1}))
    deeper_dir = os.path.join(folder, "deeper")
    deeper.save_pretrained(deeper_dir)  # its saved names: one tensor per expert, as published
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    layer = f"model.layers.{n}."
    weights.update(
        {k: w for k, w in load_file(os.path.join(deeper_dir, "model.safetensors")).items() if k.startswith(layer)}
    )
    shutil.rmtree(deeper_dir)
    dim = config["hidden_size"]
    weights[layer + "enorm.weight"] = torch.rand(dim) + 0.5
    weights[layer + "hnorm.weight"] = torch.rand(dim) + 0.5
    weights[layer + "shared_head.norm.weight"] = torch.rand(dim) + 0.5
    weights[layer + "eh_proj.weight"] = torch.randn(dim, 2 * dim) * 0.02
    weights[layer + "mlp.gate.e_score_correction_bias"] = torch.rand(config["n_routed_experts"]) * 0.1
    weights[layer + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    weights[layer + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    return folder
