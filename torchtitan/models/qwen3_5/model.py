"""Qwen3.5's text model: a hybrid of Gated DeltaNet (linear attention, gated_delta.py) and full attention.

Layer i is full attention when (i + 1) is a multiple of ``full_attention_interval`` (every 4th), Gated DeltaNet
otherwise (``Qwen35Args.layer_types``, transformers' ``layer_types``). Both kinds are pre-norm blocks with the
SwiGLU feed-forward; every RMSNorm of the model (blocks, q/k, final) is zero-centred, its weight w scaling by
1 + w and initialised to 0. The full attention is grouped-query attention with QK-norm, RoPE on the first
``partial_rotary_factor`` of each head's dims (halves rotated, transformers' layout: the HF weights need no row
permutation), and an output gate: ``wq`` yields each head's query and gate side by side, the attention's output
is multiplied by sigmoid(gate) before ``wo``. Qwen3.5's multimodal RoPE sections (``mrope_section``) rotate text
positions exactly as plain RoPE does (its three position axes are equal for text), so plain RoPE is built.

A plain nn.Module on llama's ``Transformer`` (embedding, layers, final norm, head, init units, forward): the
blocks keep llama's names (``attention``, ``attention_norm``, ``feed_forward``, ``ffn_norm``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan.models.common.init import trunc_normal_
from torchtitan.models.llama.model import CausalAttention, FeedForward, Transformer
from torchtitan.models.moe import MoE, MoEArgs, MoETransformer
from torchtitan.models.qwen3.model import Qwen3Args
from torchtitan.models.qwen3_5.gated_delta import GatedDeltaNet

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Qwen35Args(Qwen3Args):
    """Qwen3's args plus the hybrid's: the layer schedule, partial RoPE and Gated DeltaNet's shapes."""

    vocab_size: int = 248320
    head_dim: int = 256
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    full_attention_interval: int = 4
    linear_conv_kernel: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_chunk: int = 64  # the chunked rule's chunk length (transformers' and flash-linear-attention's)
    # multimodal RoPE: of the rotary frequencies, every third from the 2nd (this many) turns with the height
    # position, every third from the 3rd with the width, the rest with the time (text: all three equal)
    mrope_section: tuple[int, int, int] = (11, 11, 10)

    @property
    def layer_types(self) -> list[str]:
        every = self.full_attention_interval
        return [FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(self.n_layers)]

    @property
    def attention_layers(self) -> int:
        """The layers with softmax attention (MFU's attention term: observability/metrics.py)."""
        return self.layer_types.count(FULL_ATTENTION)

    @property
    def mixer_flops_per_token(self) -> int:
        """Gated DeltaNet's FLOPs per token that no weight accounts for, forward and backward (3x the forward), as
        its chunked form computes them, per value head: q.k and (beta k).k within the chunk (2 x 2 C dk), the
        scores times the corrections (2 C dv), the state read by q and by the keys and written (3 x 2 dk dv); the
        triangular solves left out (docs/metrics.md)."""
        chunk, dk, dv = self.linear_chunk, self.linear_key_head_dim, self.linear_value_head_dim
        per_head = 4 * chunk * dk + 2 * chunk * dv + 6 * dk * dv
        return 3 * per_head * self.linear_num_value_heads * (self.n_layers - self.attention_layers)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm in fp32 scaled by (1 + weight), weight initialised to 0 (Qwen3.5's, as Gemma's)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def compute_rope_halves(rotary_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """(max_seq_len, rotary_dim) holding [cos | sin] of each position's angles (rotary_dim / 2 of each)."""
    freqs = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * freqs  # (seq, rotary_dim / 2)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_partial_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rope.shape[-1]`` dims of each head of x (bs, seqlen, heads, head_dim) as two halves
    (x_i, x_{i + r/2}); rope ([bs,] seqlen, r) [cos | sin]."""
    cos, sin = rope.unsqueeze(-2).float().chunk(2, dim=-1)  # ([bs,] seqlen, 1, r / 2)
    rotary = rope.shape[-1]
    first, second, rest = x[..., : rotary // 2], x[..., rotary // 2 : rotary], x[..., rotary:]
    first, second = first.float(), second.float()
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return torch.cat([rotated.type_as(x), rest], dim=-1)


class GatedAttention(nn.Module):
    """Grouped-query attention with QK-norm, partial RoPE and a sigmoid output gate (Qwen3.5's full attention)."""

    def __init__(self, args: Qwen35Args):
        super().__init__()
        n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim * 2, bias=False)  # per head: query | gate
        self.wk = nn.Linear(args.dim, n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(args.head_dim, args.norm_eps)
        self.sdpa: nn.Module = CausalAttention(args.attention_backend)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x (bs, seqlen, dim); rope ([bs,] >= seqlen, rotary_dim); doc_ids as llama's attention."""
        bs, seqlen, _ = x.shape
        q, gate = self.wq(x).view(bs, seqlen, -1, 2 * self.head_dim).chunk(2, dim=-1)  # (bs, seqlen, heads, hd)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        rope = rope[..., :seqlen, :]
        q, k = apply_partial_rope(self.q_norm(q), rope), apply_partial_rope(self.k_norm(k), rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.sdpa(q, k, v) if doc_ids is None else self.sdpa(q, k, v, doc_ids=doc_ids)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1) * torch.sigmoid(gate.reshape(bs, seqlen, -1))
        return self.wo(out)


class HybridBlock(nn.Module):
    """Pre-norm token mixer (Gated DeltaNet or gated attention, by ``layer_types``) then SwiGLU, residual each."""

    def __init__(self, layer_id: int, args: Qwen35Args):
        super().__init__()
        self.layer_type = args.layer_types[layer_id]
        if self.layer_type == FULL_ATTENTION:
            self.attention: nn.Module = GatedAttention(args)
        else:
            self.attention = GatedDeltaNet(
                args.dim,
                args.linear_num_key_heads,
                args.linear_num_value_heads,
                args.linear_key_head_dim,
                args.linear_value_head_dim,
                args.linear_conv_kernel,
                args.linear_chunk,
                args.norm_eps,
            )
        moe = isinstance(args, MoEArgs) and args.is_moe_layer(layer_id)
        self.feed_forward: nn.Module = MoE(args) if moe else FeedForward(args, hidden=args.ffn_dim)
        self.attention_norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        mixed = self.attention(self.attention_norm(x), rope, doc_ids=doc_ids)
        h = x + mixed
        return h + self.feed_forward(self.ffn_norm(h))


class Qwen35Transformer(Transformer):
    """llama's Transformer with hybrid blocks, a zero-centred final norm and the partial RoPE table."""

    def __init__(self, args: Qwen35Args, build_block: Callable[[int, Qwen35Args], nn.Module] = HybridBlock):
        super().__init__(args, build_block=build_block)
        self.norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)

    def _rope_cache(self) -> torch.Tensor:
        args = self.args
        return compute_rope_halves(args.rotary_dim, args.max_seq_len, args.rope_theta)

    def rope_at(self, positions: torch.Tensor | None) -> torch.Tensor:
        """llama's, and multimodal positions (3, bs, seqlen) of time, height and width: each rotary frequency
        takes its axis's angle (``mrope_section``, transformers' interleaved layout) -> (bs, seqlen, rotary_dim)."""
        if positions is None or positions.dim() < 3:
            return super().rope_at(positions)
        rows = self.rope_cache[positions]  # (3, bs, seqlen, rotary_dim): [cos | sin] per axis
        half = rows.shape[-1] // 2
        axis = torch.zeros(half, dtype=torch.long, device=rows.device)
        axis[1 : 3 * self.args.mrope_section[1] : 3] = 1
        axis[2 : 3 * self.args.mrope_section[2] : 3] = 2
        pick = torch.cat([axis, axis]).expand(1, *rows.shape[1:])
        return rows.gather(0, pick)[0]


@dataclass(frozen=True)
class Qwen35MoEArgs(Qwen35Args, MoEArgs):
    """Qwen3.5-MoE: the hybrid's args (first in the field order, so its defaults win over llama's) and our MoE's.
    Every layer is MoE: softmax top-k renormalised, one shared expert (``moe_hidden_dim`` wide) whose output is
    scaled by sigmoid of its gate, balanced by the aux loss (router_aux_loss_coef)."""

    first_k_dense: int = 0
    score_func: str = "softmax"
    route_norm: bool = True
    num_shared_experts: int = 1
    shared_expert_gate: bool = True
    load_balance: str = "aux_loss"
    aux_loss_coeff: float = 0.001


class Qwen35MoETransformer(MoETransformer, Qwen35Transformer):
    """The hybrid with MoE feed-forwards: the MoE family's routing, balancing and expert-parallel hooks
    (MoETransformer) over Qwen35Transformer's hybrid blocks, norm and RoPE."""

    def __init__(self, args: Qwen35MoEArgs):
        super().__init__(args, build_block=HybridBlock)


__all__ = [
    "GatedAttention",
    "HybridBlock",
    "Qwen35Args",
    "Qwen35MoEArgs",
    "Qwen35MoETransformer",
    "Qwen35Transformer",
    "ZeroCenteredRMSNorm",
]
