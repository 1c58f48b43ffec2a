"""gpt-oss flavors ("gpt_oss"): 20B and 120B at the published shapes (openai/gpt-oss-20b, -120b config.json).

Both: dim 2880, 64 query heads and 8 kv heads of head_dim 64, every layer MoE (experts of width 2880, top 4,
clamped SwiGLU with biases), sliding window 128 on the even layers, YaRN RoPE (theta 150000, factor 32 over an
original 4096 tokens), vocab 201088 (o200k_harmony). 20B: 24 layers, 32 experts; 120B: 36 layers, 128
experts. They balance with the switch aux loss at transformers' ``router_aux_loss_coef`` (0.9) converted to
our per-layer weight (args.aux_loss_coeff_from_hf), so they export.

debugmodel: gpt-oss's features at CPU size (dim 256, 4 layers sliding/full with a 16-token window, 8 heads
over 2 kv heads of head_dim 64 != dim / n_heads, 8 experts of width 256, top 2, YaRN as published).
debugmodel_tiny: the loss-parity tests' size (dim 64, 4 layers, 4 heads, 2 kv heads, 4 experts, window 16),
balanced by the expert bias as the other families' tiny MoE flavors (layout-invariant; does not export).
"""

import dataclasses

from torchtitan.models.common.rope.yarn import YarnScaling
from torchtitan.models.gpt_oss.args import GptOssArgs, aux_loss_coeff_from_hf
from torchtitan.models.gpt_oss.model import GptOssTransformer, apply_sinks

__all__ = ["GptOssArgs", "GptOssTransformer", "YarnScaling", "apply_sinks", "gpt_oss_configs"]

HF_ROUTER_AUX_LOSS_COEF = 0.9  # both published config.json files


def _published(n_layers: int, num_experts: int) -> GptOssArgs:
    return GptOssArgs(
        dim=2880,
        n_layers=n_layers,
        n_heads=64,
        n_kv_heads=8,
        head_dim=64,
        vocab_size=201088,
        max_seq_len=131072,
        num_experts=num_experts,
        top_k=4,
        moe_hidden_dim=2880,
        load_balance="aux_loss",
        aux_loss_coeff=aux_loss_coeff_from_hf(HF_ROUTER_AUX_LOSS_COEF, 4, n_layers),
    )


gpt_oss_configs = {
    "debugmodel": GptOssArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        head_dim=64,
        max_seq_len=2048,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=256,
        sliding_window=16,
        load_balance="aux_loss",
        aux_loss_coeff=aux_loss_coeff_from_hf(HF_ROUTER_AUX_LOSS_COEF, 2, 4),
    ),
    "20B": _published(n_layers=24, num_experts=32),
    "120B": _published(n_layers=36, num_experts=128),
}
# the loss-parity tests' size; the expert bias balances on global counts, so every layout trains alike
gpt_oss_configs["debugmodel_tiny"] = dataclasses.replace(
    gpt_oss_configs["debugmodel"],
    dim=64,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    num_experts=4,
    moe_hidden_dim=64,
    load_balance="bias",
)
