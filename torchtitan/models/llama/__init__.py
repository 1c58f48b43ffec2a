"""Llama 3 flavors with the published shapes (vocab 128256 = Llama 3's tokenizer).

The trainer replaces ``vocab_size`` with its tokenizer's size and ``max_seq_len`` with
``training.seq_len`` (a new ModelArgs; these stay untouched). ``max_seq_len`` here is the longest
context the flavor supports.
"""

import dataclasses

from torchtitan.models.llama.model import ModelArgs, RopeScaling, Transformer

__all__ = ["ModelArgs", "RopeScaling", "Transformer", "llama3_configs"]

# Llama 3.1's published long-context RoPE scaling (8B, 70B, 405B): 8192 -> 131072 tokens.
LLAMA31_ROPE_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)

LLAMA32_ROPE_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)

llama3_configs = {
    "debugmodel": ModelArgs(dim=256, n_layers=8, n_heads=16, rope_theta=500000, max_seq_len=2048),
    # Llama 3.2's features at debug size: the output head tied to the embedding, RoPE scaled (factor
    # 32) from a 64-token original context, so training at seq_len 64+ exercises both.
    "debugmodel_tied": ModelArgs(
        dim=256,
        n_layers=8,
        n_heads=16,
        rope_theta=500000,
        rope_scaling=RopeScaling(factor=32.0, original_max_seq_len=64),
        max_seq_len=2048,
        tie_word_embeddings=True,
    ),
    # The loss-parity tests' size (tests/runs/training/test_parity_matrix.py): 4 layers, so 2 pipeline ranks can hold
    # 2 stages each, 4 heads for TP 2 x CP 2; ~20x less compute per step than debugmodel on CPU.
    "debugmodel_tiny": ModelArgs(dim=64, n_layers=4, n_heads=4, rope_theta=500000, max_seq_len=2048),
    # Llama 3.2 1B and 3B: RoPE scaling with factor 32, the output head tied to the embedding.
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
        rope_scaling=LLAMA32_ROPE_SCALING,
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_theta=500000,
        rope_scaling=LLAMA32_ROPE_SCALING,
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000,
        rope_scaling=LLAMA31_ROPE_SCALING,
        max_seq_len=131072,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000,
        rope_scaling=LLAMA31_ROPE_SCALING,
        max_seq_len=131072,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000,
        rope_scaling=LLAMA31_ROPE_SCALING,
        max_seq_len=131072,
    ),
}
# The shipped old-checkpoint assets' size (tests/assets/checkpoints): a few hundred KB with a small tokenizer.
llama3_configs["debugmodel_nano"] = ModelArgs(
    dim=32, n_layers=2, n_heads=2, multiple_of=32, rope_theta=500000, max_seq_len=2048
)
# debugmodel_tied at the parity size (its RoPE scaling and tied head kept)
llama3_configs["debugmodel_tied_tiny"] = dataclasses.replace(
    llama3_configs["debugmodel_tied"], dim=64, n_layers=4, n_heads=4
)
