"""Qwen3.5 ("qwen3_5"): Gated DeltaNet in three layers of every four, gated full attention in the fourth.

The text model: model.py, gated_delta.py (Gated DeltaNet is linear attention).

debugmodel: the debug size (8 layers: 6 Gated DeltaNet, 2 full attention), head sizes smaller than published but
every feature on (grouped value heads, partial RoPE, the output gate); debugmodel_tiny: the parity tests' size (4
layers, the schedule linear, linear, linear, full), the chunked rule at chunk 16 so a 64-token window holds
several chunks.

The published dense text models (their config.json: vocab 248320, head_dim 256, RoPE theta 1e7 on a quarter of each
head, Gated DeltaNet's conv 4 and key/value heads of 128 with 16 key heads, full attention every 4th layer):
0.8B, 2B and 4B tie the head to the embedding, 9B and 27B do not. Their parameter counts equal transformers'
``Qwen3_5ForCausalLM`` of the same config (tests/unit/test_qwen3_5.py).

Qwen3.5-MoE ("qwen3_5_moe"): the hybrid with every feed-forward an MoE (softmax top-k renormalised, one shared
expert scaled by its sigmoid gate). debugmodel: the dense debug model's mixers with 8 experts of width 128, top 2,
balanced by the expert bias (aux-loss free, the global counts: every layout, pipeline parallel included, trains it
to the same loss); debugmodel_aux_loss: the same with Qwen3.5-MoE's own aux loss (what exports to Hugging Face);
debugmodel_tiny: the parity tests' size. The published 35B-A3B, 122B-A10B and 397B-A17B from their config.json
(vocab 248320, head_dim 256, untied), parameter counts equal to transformers' ``Qwen3_5MoeForCausalLM``.
"""

import dataclasses

from torchtitan.models.qwen3_5.model import Qwen35Args, Qwen35MoEArgs, Qwen35MoETransformer, Qwen35Transformer
from torchtitan.models.qwen3_5.multimodal import Qwen35MoEVLArgs, Qwen35VLArgs
from torchtitan.models.qwen3_5.vision import VisionArgs

__all__ = [
    "Qwen35Args",
    "Qwen35MoEArgs",
    "Qwen35MoETransformer",
    "Qwen35Transformer",
    "qwen3_5_configs",
    "qwen3_5_moe_configs",
    "qwen3_5_moe_vl_configs",
    "qwen3_5_vl_configs",
]

_DEBUG = dict(
    dim=256,
    n_layers=8,
    n_heads=8,
    n_kv_heads=2,
    head_dim=32,
    ffn_dim=768,
    vocab_size=2048,
    max_seq_len=2048,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
)
# the parity tests' size: 4 layers (linear, linear, linear, full), the chunked rule at chunk 16
_TINY = dict(
    dim=64,
    n_layers=4,
    n_heads=4,
    head_dim=16,
    ffn_dim=192,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_chunk=16,
)


def _published(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, value_heads: int, tied: bool):
    return Qwen35Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        linear_num_value_heads=value_heads,
        max_seq_len=262144,
        tie_word_embeddings=tied,
    )


qwen3_5_configs = {
    "debugmodel": Qwen35Args(**_DEBUG),
    "debugmodel_tiny": Qwen35Args(**{**_DEBUG, **_TINY}),
    "0.8B": _published(1024, 24, 8, 2, 3584, 16, tied=True),
    "2B": _published(2048, 24, 8, 2, 6144, 16, tied=True),
    "4B": _published(2560, 32, 16, 4, 9216, 32, tied=True),
    "9B": _published(4096, 32, 16, 4, 12288, 32, tied=False),
    "27B": _published(5120, 64, 24, 4, 17408, 48, tied=False),
}


def _published_moe(dim: int, n_layers: int, n_heads: int, experts: int, top_k: int, width: int, value_heads: int):
    return Qwen35MoEArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=2,
        num_experts=experts,
        top_k=top_k,
        moe_hidden_dim=width,
        linear_num_value_heads=value_heads,
        max_seq_len=262144,
    )


_DEBUG_MOE = Qwen35MoEArgs(**_DEBUG, num_experts=8, top_k=2, moe_hidden_dim=128, load_balance="bias")
qwen3_5_moe_configs = {
    "debugmodel": _DEBUG_MOE,
    "debugmodel_aux_loss": dataclasses.replace(_DEBUG_MOE, load_balance="aux_loss"),
    "debugmodel_tiny": dataclasses.replace(_DEBUG_MOE, **_TINY, num_experts=4, moe_hidden_dim=64),
    "35B-A3B": _published_moe(2048, 40, 16, 256, 8, 512, 32),
    "122B-A10B": _published_moe(3072, 48, 32, 256, 8, 1024, 64),
    "397B-A17B": _published_moe(4096, 60, 32, 512, 10, 1024, 64),
}


# Images (qwen3_5_vl, qwen3_5_moe_vl): the text flavors with the tower. Debug: a 2-block tower of width 64 on 8x8
# patches (a 48x48 image is 36 patches, 9 image tokens), the vision tokens at the shipped shapes tokenizer's ids
# (tests/assets/vlm: <|vision_start|> 3, <|image_pad|> 4, <|vision_end|> 5). Published: the 9B's and 27B's tower
# (their config.json's vision_config: 27 blocks of width 1152 on 16x16 patches) and Qwen3.5's token ids.
_DEBUG_TOWER = dict(depth=2, dim=64, ffn_dim=128, n_heads=4, patch_size=8, num_position_embeddings=64)
_DEBUG_TOKENS = dict(vision_start_token_id=3, image_token_id=4, vision_end_token_id=5)


def _with_tower(args, cls, **tower):
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    return cls(**fields, vision=VisionArgs(out_dim=args.dim, **tower))


def _debug_vl(args, cls):
    return dataclasses.replace(_with_tower(args, cls, **_DEBUG_TOWER), **_DEBUG_TOKENS)


qwen3_5_vl_configs = {
    "debugmodel": _debug_vl(qwen3_5_configs["debugmodel"], Qwen35VLArgs),
    "debugmodel_tiny": _debug_vl(qwen3_5_configs["debugmodel_tiny"], Qwen35VLArgs),
    "9B": _with_tower(qwen3_5_configs["9B"], Qwen35VLArgs),
    "27B": _with_tower(qwen3_5_configs["27B"], Qwen35VLArgs),
}
qwen3_5_moe_vl_configs = {
    "debugmodel": _debug_vl(qwen3_5_moe_configs["debugmodel"], Qwen35MoEVLArgs),
    "debugmodel_aux_loss": _debug_vl(qwen3_5_moe_configs["debugmodel_aux_loss"], Qwen35MoEVLArgs),
    "debugmodel_tiny": _debug_vl(qwen3_5_moe_configs["debugmodel_tiny"], Qwen35MoEVLArgs),
}
