"""DeepSeek-V3 flavors ("deepseek_v3"): the published shapes, and debug sizes with every feature on.

debugmodel: dim 256, 6 layers (layer 0 dense), 8 heads of MLA with a q bottleneck (q_lora_rank 128)
and a 64-wide K/V latent, YaRN RoPE (factor 4 from a 512-token original context); MoE layers of 8
experts (width 128) in 2 groups, each token routed to its top 2 within its best group, sigmoid
scores, normalised weights times 2.5, one shared expert, balanced with the expert bias.
debugmodel_tiny: the loss-parity tests' size (dim 64, 4 layers, 4 heads, 4 experts of width 64 in 2
groups, no q bottleneck). debugmodel_aux_loss: debugmodel with DeepSeek's sequence-wise aux loss
instead of the bias.

16B: DeepSeek-V2-Lite's published config (15.7B parameters): softmax routing, top 6 of 64 experts
unnormalised, two shared experts' width, the sequence-wise aux loss (0.001). 671B: DeepSeek-V3's
config.json (its multi-token-prediction layer: ``model.mtp_layers``). kimi_k2: Kimi K2's (384 experts, 64 heads,
layer 0 dense, 1.03T parameters). Vocab sizes as published; the trainer replaces them with the
tokenizer's (and ``max_seq_len`` with ``training.seq_len``).
"""

import dataclasses

from torchtitan.models.common.rope.yarn import YarnScaling
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.deepseek_v3.model import DeepSeekV3Transformer, MLAttention

__all__ = ["DeepSeekV3Args", "DeepSeekV3Transformer", "MLAttention", "YarnScaling", "deepseek_v3_configs"]


def _published(**fields) -> DeepSeekV3Args:
    """The 7168-wide models (DeepSeek-V3, Kimi K2): MLA at 128 heads' shapes, 2048-wide experts."""
    return DeepSeekV3Args(
        **{
            "dim": 7168,
            "n_layers": 61,
            "q_lora_rank": 1536,
            "ffn_dim": 18432,
            "moe_hidden_dim": 2048,
            "top_k": 8,
            **fields,
        }
    )


deepseek_v3_configs = {
    "debugmodel": DeepSeekV3Args(
        dim=256,
        n_layers=6,
        n_heads=8,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        ffn_dim=768,
        num_experts=8,
        top_k=2,
        num_expert_groups=2,
        top_k_groups=1,
        moe_hidden_dim=128,
        route_scale=2.5,
        first_k_dense=1,
        rope_scaling=YarnScaling(factor=4.0, original_max_seq_len=512, mscale=1.0, mscale_all_dim=1.0),
        max_seq_len=2048,
    ),
    # DeepSeek-V2-Lite (HF deepseek-ai/DeepSeek-V2-Lite config.json)
    "16B": DeepSeekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        q_lora_rank=0,
        ffn_dim=10944,
        num_experts=64,
        top_k=6,
        moe_hidden_dim=1408,
        shared_expert_multiplier=2,
        first_k_dense=1,
        score_func="softmax",
        route_norm=False,
        load_balance="aux_loss",
        aux_loss_per_sequence=True,
        aux_loss_coeff=0.001,
        vocab_size=102400,
        rope_scaling=YarnScaling(factor=40.0, original_max_seq_len=4096, mscale=0.707, mscale_all_dim=0.707),
        max_seq_len=163840,
    ),
    # DeepSeek-V3 (HF deepseek-ai/DeepSeek-V3 config.json)
    "671B": _published(
        n_heads=128,
        num_experts=256,
        num_expert_groups=8,
        top_k_groups=4,
        route_scale=2.5,
        first_k_dense=3,
        vocab_size=129280,
        rope_scaling=YarnScaling(factor=40.0, original_max_seq_len=4096, mscale=1.0, mscale_all_dim=1.0),
        max_seq_len=163840,
    ),
    # Kimi K2 (HF moonshotai/Kimi-K2-Instruct config.json)
    "kimi_k2": _published(
        n_heads=64,
        num_experts=384,
        route_scale=2.827,
        first_k_dense=1,
        vocab_size=163840,
        rope_theta=50000.0,
        rope_scaling=YarnScaling(
            factor=32.0, original_max_seq_len=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
        ),
        max_seq_len=131072,
    ),
}
# The loss-parity tests' size: dim 64, 4 layers (layer 0 dense), 4 heads, 4 experts of width 64 in 2 groups.
deepseek_v3_configs["debugmodel_tiny"] = dataclasses.replace(
    deepseek_v3_configs["debugmodel"],
    dim=64,
    n_layers=4,
    n_heads=4,
    q_lora_rank=0,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    ffn_dim=192,
    num_experts=4,
    moe_hidden_dim=64,
)
# DeepSeek's sequence-wise balance loss instead of the expert bias (not under pipeline parallel).
deepseek_v3_configs["debugmodel_aux_loss"] = dataclasses.replace(
    deepseek_v3_configs["debugmodel"], load_balance="aux_loss", aux_loss_per_sequence=True, aux_loss_coeff=0.001
)
