"""Qwen3 dense flavors ("qwen3") at the published shapes (vocab 151936 = Qwen3's tokenizer).

The small sizes (0.6B, 1.7B, 4B) tie the output head to the embedding, as published. debugmodel:
llama's debug size with Qwen3's features (QK-norm, head_dim 32 != dim / n_heads = 16, a given FFN
width), untied so that every layout, pipeline parallel included, can train it.
"""

from torchtitan.models.qwen3.model import Qwen3Args, Qwen3Transformer

__all__ = ["Qwen3Args", "Qwen3Transformer", "qwen3_configs"]


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
    "0.6B": _published(1024, 28, 16, 3072, tied=True),
    "1.7B": _published(2048, 28, 16, 6144, tied=True),
    "4B": _published(2560, 36, 32, 9728, tied=True),
    "8B": _published(4096, 36, 32, 12288, tied=False),
    "14B": _published(5120, 40, 40, 17408, tied=False),
    "32B": _published(5120, 64, 64, 25600, tied=False),
}
