"""DeepSeek-V4 flavors ("deepseek_v4"): the published Flash shapes, and debug sizes with every feature on.

debugmodel: dim 128, 4 layers (sliding, compressed-sparse, heavily-compressed, compressed-sparse; the first
hash-routed), 4 heads of 32 sharing one key/value head, RoPE on the last 16 dims, a 16-token window, CSA every 4
tokens keeping the top 8 entries, HCA every 16, 4 residual streams, 8 experts (width 128) top 2, groups of 2 heads
projected to 32 each. debugmodel_tiny: the parity tests' size (dim 64, heads of 16, 4 experts, 2 streams).

flash: transformers' DeepseekV4Config defaults, the DeepSeek-V4-Flash(-Base) shapes (43 layers, dim 4096, 64 heads
of 512, 256 experts of width 2048, top 6, the first 3 layers hash-routed), with Flash's attention schedule (two
sliding layers, then CSA / HCA alternating: compress_ratios 0, 0, 4, 128, 4, ...) and YaRN (factor 16 over a
65536-token original context) on the compressed layers' RoPE. Without the multi-token-prediction layer.
"""

import dataclasses

from torchtitan.models.common.rope.yarn import YarnScaling
from torchtitan.models.deepseek_v4.args import CSA, HASH_MOE, HCA, MOE, SLIDING, DeepSeekV4Args
from torchtitan.models.deepseek_v4.model import DeepSeekV4Transformer

__all__ = ["DeepSeekV4Args", "DeepSeekV4Transformer", "deepseek_v4_configs"]

_FLASH_LAYERS = 43

deepseek_v4_configs = {
    "debugmodel": DeepSeekV4Args(
        dim=128,
        n_layers=4,
        n_heads=4,
        head_dim=32,
        rope_dim=16,
        q_lora_rank=64,
        max_seq_len=2048,
        layer_types=(SLIDING, CSA, HCA, CSA),
        mlp_layer_types=(HASH_MOE, MOE, MOE, MOE),
        csa_rate=4,
        hca_rate=16,
        sliding_window=16,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=2,
        index_head_dim=32,
        index_topk=8,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=128,
    ),
    "flash": DeepSeekV4Args(
        n_layers=_FLASH_LAYERS,
        dim=4096,
        n_heads=64,
        max_seq_len=1048576,
        layer_types=(SLIDING, SLIDING) + tuple(CSA if i % 2 == 0 else HCA for i in range(2, _FLASH_LAYERS)),
        mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * (_FLASH_LAYERS - 3),
        compress_yarn=YarnScaling(factor=16.0, original_max_seq_len=65536, attention_factor=1.0),
        num_experts=256,
        top_k=6,
        moe_hidden_dim=2048,
    ),
}
deepseek_v4_configs["debugmodel_tiny"] = dataclasses.replace(
    deepseek_v4_configs["debugmodel"],
    dim=64,
    head_dim=16,
    rope_dim=8,
    q_lora_rank=32,
    o_lora_rank=16,
    index_head_dim=16,
    num_experts=4,
    moe_hidden_dim=64,
    hc_mult=2,
)
