"""Qwen3 dense flavors ("qwen3") at the published shapes (vocab 151936 = Qwen3's tokenizer).

The small sizes (0.6B, 1.7B, 4B) tie the output head to the embedding, as published. debugmodel:
llama's debug size with Qwen3's features (QK-norm, head_dim 32 != dim / n_heads = 16, a given FFN
width), untied so that every layout, pipeline parallel included, can train it.

Qwen3-MoE ("qwen3_moe"): 30B-A3B and 235B-A22B as published (128 experts, top 8, every layer MoE);
debugmodel: the dense debug model's attention with 8 experts of width 128, top 2, balanced with the
expert bias (aux-loss free), whose updates use the global token counts, so every layout trains it
to the same loss; debugmodel_aux_loss: the same with Qwen3-MoE's own aux loss, over the global
micro-batch (training.moe_aux_loss_scope; per rank, as transformers computes it, layouts differ).
"""

import dataclasses

from torchtitan.models.qwen3.model import Qwen3Args, Qwen3MoEArgs, Qwen3MoETransformer, Qwen3Transformer

__all__ = ["Qwen3Args", "Qwen3MoEArgs", "Qwen3MoETransformer", "Qwen3Transformer", "qwen3_configs", "qwen3_moe_configs"]


def _published(dim: int, n_layers: int, n_heads: int, ffn_dim: int, tied: bool) -> Qwen3Args:
    return Qwen3Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=ffn_dim,
        vocab_size=151936,
        max_seq_len=40960,
        tie_word_embeddings=tied,
    )


qwen3_configs = {
    "debugmodel": Qwen3Args(dim=256, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=32, ffn_dim=768, max_seq_len=2048),
    # the loss-parity tests' size, still with head_dim (32) != dim / n_heads (16)
    "debugmodel_tiny": Qwen3Args(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=192, max_seq_len=2048
    ),
    "0.6B": _published(1024, 28, 16, 3072, tied=True),
    "1.7B": _published(2048, 28, 16, 6144, tied=True),
    "4B": _published(2560, 36, 32, 9728, tied=True),
    "8B": _published(4096, 36, 32, 12288, tied=False),
    "14B": _published(5120, 40, 40, 17408, tied=False),
    "32B": _published(5120, 64, 64, 25600, tied=False),
}


def _published_moe(dim: int, n_layers: int, n_heads: int, moe_hidden_dim: int) -> Qwen3MoEArgs:
    return Qwen3MoEArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=4,
        head_dim=128,
        num_experts=128,
        top_k=8,
        moe_hidden_dim=moe_hidden_dim,
        vocab_size=151936,
        max_seq_len=40960,
        norm_eps=1e-6,  # Qwen3's (the class defaults are llama's, see Qwen3MoEArgs)
        rope_theta=1_000_000.0,
    )


qwen3_moe_configs = {
    "debugmodel": Qwen3MoEArgs(
        dim=256,
        n_layers=8,
        n_heads=16,
        n_kv_heads=8,
        head_dim=32,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=128,
        max_seq_len=4096,  # as upstream's debugmodel_moe (the trainer builds it at training.seq_len)
        load_balance="bias",
    ),
    "30B-A3B": _published_moe(2048, 48, 32, 768),
    "235B-A22B": _published_moe(4096, 94, 64, 1536),
}
qwen3_moe_configs["debugmodel_aux_loss"] = dataclasses.replace(qwen3_moe_configs["debugmodel"], load_balance="aux_loss")
# the loss-parity tests' size: 4 experts of width 64, top 2, head_dim 32 != dim / n_heads
qwen3_moe_configs["debugmodel_tiny"] = dataclasses.replace(
    qwen3_moe_configs["debugmodel"], dim=64, n_layers=4, n_heads=4, n_kv_heads=2, num_experts=4, moe_hidden_dim=64
)
