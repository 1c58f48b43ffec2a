"""Qwen3.5's text model ("qwen3_5"): Gated DeltaNet (linear attention) in three layers of every four, gated full
attention in the fourth (model.py, gated_delta.py).

debugmodel: the debug size (8 layers: 6 Gated DeltaNet, 2 full attention), head sizes smaller than published but
every feature on (grouped value heads, partial RoPE, the output gate); debugmodel_tiny: the parity tests' size (4
layers, the schedule linear, linear, linear, full), the chunked rule at chunk 16 so a 64-token window holds
several chunks.

The published dense text models (their config.json: vocab 248320, head_dim 256, RoPE theta 1e7 on a quarter of each
head, Gated DeltaNet's conv 4 and key/value heads of 128 with 16 key heads, full attention every 4th layer):
0.8B, 2B and 4B tie the head to the embedding, 9B and 27B do not. Their parameter counts equal transformers'
``Qwen3_5ForCausalLM`` of the same config (tests/unit/test_qwen3_5.py).
"""

from torchtitan.models.qwen3_5.model import Qwen35Args, Qwen35Transformer

__all__ = ["Qwen35Args", "Qwen35Transformer", "qwen3_5_configs"]

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
    "debugmodel_tiny": Qwen35Args(
        **{
            **_DEBUG,
            "dim": 64,
            "n_layers": 4,
            "n_heads": 4,
            "head_dim": 16,
            "ffn_dim": 192,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_chunk": 16,
        }
    ),
    "0.8B": _published(1024, 24, 8, 2, 3584, 16, tied=True),
    "2B": _published(2048, 24, 8, 2, 6144, 16, tied=True),
    "4B": _published(2560, 32, 16, 4, 9216, 32, tied=True),
    "9B": _published(4096, 32, 16, 4, 12288, 32, tied=False),
    "27B": _published(5120, 64, 24, 4, 17408, 48, tied=False),
}
