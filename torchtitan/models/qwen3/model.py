"""Qwen3 (dense and MoE): Llama's architecture with QK-norm, a head_dim of its own and a given FFN width.

A plain nn.Module, like llama: the blocks are llama's ``TransformerBlock`` whose attention has a
per-head RMSNorm on q and k (before RoPE) and whose feed-forward is llama's SwiGLU at
``ffn_dim``. Submodule names are llama's, so llama's TP, CP, PP, FSDP and float8 plans apply; TP adds
the q/k norms (replicated weights on each rank's own heads). Qwen3-MoE is llama3_moe's MoE (routed
experts, no shared expert, softmax top-k renormalised) under the same attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from torchtitan.models.llama.model import FeedForward, ModelArgs, Transformer, TransformerBlock
from torchtitan.models.moe import MoE, MoEArgs, MoETransformer


@dataclass(frozen=True)
class Qwen3Args(ModelArgs):
    """Llama's args plus Qwen3's: ``head_dim`` is a field (not dim // n_heads), ``ffn_dim`` the SwiGLU width."""

    head_dim: int = 128  # replaces ModelArgs.head_dim (a property there)
    ffn_dim: int = 3072
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0


def build_qwen3_block(layer_id: int, args: Qwen3Args) -> TransformerBlock:
    block = TransformerBlock(layer_id, args, feed_forward=FeedForward(args, hidden=args.ffn_dim))
    _add_qk_norm(block, args)
    return block


def _add_qk_norm(block: TransformerBlock, args: Qwen3Args) -> None:
    block.attention.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
    block.attention.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)


class Qwen3Transformer(Transformer):
    """Llama's Transformer (embedding, RoPE, norm, output, tying, init units, forward) with Qwen3 blocks."""

    def __init__(self, args: Qwen3Args):
        super().__init__(args, build_block=build_qwen3_block)


@dataclass(frozen=True)
class Qwen3MoEArgs(MoEArgs, Qwen3Args):
    """Qwen3-MoE: Qwen3's attention and our MoE fields. Every layer is MoE (``first_k_dense = 0``),
    softmax routing with the top-k probabilities renormalised, no shared expert."""

    # norm_eps and rope_theta default to llama's (1e-5, 1e4: MoEArgs's fields come later in the field order), as the
    # debug flavors' checkpoints recorded them; the published flavors set Qwen3's (qwen3/__init__.py)
    first_k_dense: int = 0
    score_func: str = "softmax"
    route_norm: bool = True
    num_shared_experts: int = 0
    load_balance: str = "aux_loss"
    aux_loss_coeff: float = 0.001  # Qwen3-MoE's router_aux_loss_coef


def build_qwen3_moe_block(layer_id: int, args: Qwen3MoEArgs) -> TransformerBlock:
    dense = FeedForward(args, hidden=args.ffn_dim)
    block = TransformerBlock(layer_id, args, feed_forward=MoE(args) if args.is_moe_layer(layer_id) else dense)
    _add_qk_norm(block, args)
    return block


class Qwen3MoETransformer(MoETransformer):
    """llama's MoE Transformer (routing, load balancing, expert parallel hooks) with Qwen3's attention."""

    def __init__(self, args: Qwen3MoEArgs):
        super().__init__(args, build_block=build_qwen3_moe_block)
