"""Qwen3 (dense): Llama's architecture with QK-norm, a head_dim of its own and a given FFN width.

A plain nn.Module, like llama: the blocks are llama's ``TransformerBlock`` whose attention has a
per-head RMSNorm on q and k (before RoPE) and whose feed-forward is llama's SwiGLU at
``ffn_dim``. Submodule names are llama's, so llama's TP, CP, PP, FSDP and float8 plans apply; TP adds
the q/k norms (replicated weights on each rank's own heads).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from torchtitan.models.llama.model import FeedForward, ModelArgs, Transformer, TransformerBlock


@dataclass(frozen=True)
class Qwen3Args(ModelArgs):
    """Llama's args plus Qwen3's: ``head_dim`` is a field (not dim // n_heads), ``ffn_dim`` the SwiGLU width."""

    head_dim: int = 128  # replaces ModelArgs.head_dim (a property there)
    ffn_dim: int = 3072
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0


def build_qwen3_block(layer_id: int, args: Qwen3Args) -> TransformerBlock:
    block = TransformerBlock(layer_id, args, feed_forward=FeedForward(args, hidden=args.ffn_dim))
    block.attention.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
    block.attention.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
    return block


class Qwen3Transformer(Transformer):
    """Llama's Transformer (embedding, RoPE, norm, output, tying, init units, forward) with Qwen3 blocks."""

    def __init__(self, args: Qwen3Args):
        super().__init__(args, build_block=build_qwen3_block)
