"""gpt-oss (OpenAI's open-weight MoE models, ``GptOssForCausalLM``). A plain nn.Module, llama's layout.

Blocks are llama's shape (``attention_norm``, ``attention`` with ``wq``/``wk``/``wv``/``wo``, ``ffn_norm``,
``feed_forward``) so the parallelisms that walk llama's names apply; what differs:

* attention: biased projections, grouped-query heads, a learned logit per head (``sinks``) that joins
  every softmax denominator, and a sliding window on alternating layers (``GptOssArgs.layer_window``);
* the feed-forward is an MoE on every layer (moe.py): a biased router, clamped-SwiGLU experts with biases;
* YaRN RoPE, whose attention scaling is folded into the cos/sin table.

Heads are read from tensor shapes (``view(bs, seqlen, -1, head_dim)``) and the sinks through ``_local``
(a tensor-parallel plan shards them over heads, Shard(0), like wq's output), so the model imports nothing
distributed. The attention kernel is one module (``attention.sdpa``), swappable like llama's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchtitan.models.gpt_oss.args import GptOssArgs
from torchtitan.models.gpt_oss.moe import GptOssMoE
from torchtitan.models.llama.model import TransformerBlock, apply_rotary_emb, compute_rope_cache
from torchtitan.models.moe.model import MoETransformer
from torchtitan.models.moe.moe import _local
from torchtitan.models.yarn import compute_yarn_rope_cache


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention ``out`` (bs, heads, sq, head_dim) with logsumexp ``lse`` (bs, heads, sq) of its scores, corrected
    as if each head's ``sinks`` (heads,) logit had joined the softmax denominator (and its value were 0).

    Exact: with Z = sum_j exp(s_j) = exp(lse), the sink's softmax gives weights exp(s_j) / (Z + exp(sink)), so
        out_sink = out * Z / (Z + exp(sink)) = out / (1 + exp(sink - lse)) = out * sigmoid(lse - sink).
    Blockwise kernels (ring attention) merge blocks into (out, lse) first and apply this once, at the end.
    """
    gate = torch.sigmoid(lse.float() - sinks.float().view(-1, 1))  # (bs, heads, sq)
    return out * gate.unsqueeze(-1).to(out.dtype)


def attention_mask(seqlen: int, window: int | None, doc_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(sq, sk) or (bs, 1, sq, sk) bool, True = visible: causal, within ``window`` tokens (query k sees key j when
    k - window < j <= k, transformers' ``sliding_window_overlay``), and in the same document when ``doc_ids``."""
    q = torch.arange(seqlen, device=device)[:, None]
    k = torch.arange(seqlen, device=device)[None, :]
    visible = k <= q if window is None else (k <= q) & (k > q - window)  # (sq, sk)
    if doc_ids is None:
        return visible
    return visible & (doc_ids[:, :, None] == doc_ids[:, None, :]).unsqueeze(1)  # (bs, 1, sq, sk)


def masked_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(head_dim), masked) v, and the logsumexp of each row's visible scores; fp32.

    q (bs, n_heads, s, head_dim); k, v (bs, n_kv_heads, s, head_dim); mask (s, s) or (bs, 1, s, s), every row
    seeing at least its own token -> out (bs, n_heads, s, head_dim), lse (bs, n_heads, s). The explicit
    (s, s) scores: exact and differentiable in both outputs on every device, memory O(s^2) per head.
    """
    bs, n_heads, s, head_dim = q.shape
    n_kv_heads = k.shape[1]
    # query head h uses kv head h // n_rep (transformers' repeat_kv): group the query heads per kv head
    qg = q.float().view(bs, n_kv_heads, n_heads // n_kv_heads, s, head_dim)  # (bs, hkv, n_rep, s, d)
    scores = qg @ k.float().unsqueeze(2).transpose(-1, -2) * head_dim**-0.5  # (bs, hkv, n_rep, s, s)
    scores = scores.flatten(1, 2).masked_fill(~mask, float("-inf"))  # (bs, n_heads, s, s)
    lse = scores.logsumexp(dim=-1)  # (bs, n_heads, s)
    probs = (scores - lse.unsqueeze(-1)).exp().view(bs, n_kv_heads, -1, s, s)
    out = probs @ v.float().unsqueeze(2)  # (bs, hkv, n_rep, s, d)
    return out.flatten(1, 2), lse


class SinkAttention(nn.Module):
    """The kernel of one layer: causal (sliding-window) attention with sinks, block-causal over ``doc_ids``.

    A module so that context parallel can swap in a ring kernel with the same call, one that masks its blocks
    with this layer's ``window``, merges their (out, lse) and applies ``apply_sinks`` once at the end.
    """

    def __init__(self, window: int | None):
        super().__init__()
        self.window = window  # tokens a query sees (itself included); None: the whole causal context

    def extra_repr(self) -> str:
        return f"window={self.window}"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (bs, n_heads, s, head_dim); k, v (bs, n_kv_heads, s, head_dim); sinks (n_heads,); doc_ids (bs, s) -> like q."""
        mask = attention_mask(q.shape[2], self.window, doc_ids, q.device)
        out, lse = masked_attention_with_lse(q, k, v, mask)
        return apply_sinks(out, lse, sinks).to(q.dtype)


class GptOssAttention(nn.Module):
    def __init__(self, layer_id: int, args: GptOssArgs):
        super().__init__()
        n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=True)
        self.wk = nn.Linear(args.dim, n_kv_heads * args.head_dim, bias=True)
        self.wv = nn.Linear(args.dim, n_kv_heads * args.head_dim, bias=True)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=True)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))  # one logit per query head
        self.sdpa: nn.Module = SinkAttention(args.layer_window(layer_id))
        # llama's QK-norm slots, read by the TP plan; gpt-oss has none
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            nn.init.zeros_(linear.bias)
        nn.init.trunc_normal_(self.sinks, mean=0.0, std=0.02)  # transformers: normal(0, initializer_range)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x (bs, seqlen, dim); rope ([bs,] >= seqlen, head_dim); doc_ids (bs, seqlen) or None (causal)."""
        bs, seqlen, _ = x.shape
        # -1: the local head count, which tensor parallel divides by the TP degree
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_heads, head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_kv_heads, head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_kv_heads, head_dim)
        rope = rope[..., :seqlen, :]
        q, k = apply_rotary_emb(q, rope), apply_rotary_emb(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        sinks = _local(self.sinks)  # (local n_heads,): this rank's heads under TP
        out = self.sdpa(q, k, v, sinks) if doc_ids is None else self.sdpa(q, k, v, sinks, doc_ids=doc_ids)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))  # (bs, seqlen, dim)


def build_gpt_oss_block(layer_id: int, args: GptOssArgs) -> TransformerBlock:
    """Llama's pre-norm block with gpt-oss's attention (sinks, the layer's window) and MoE."""
    return TransformerBlock(layer_id, args, feed_forward=GptOssMoE(args), attention=GptOssAttention(layer_id, args))


class GptOssTransformer(MoETransformer):
    """llama's MoE Transformer (embedding, norm, output, init units, forward, load balancing) with gpt-oss
    blocks and YaRN RoPE."""

    def __init__(self, args: GptOssArgs, build_block: Callable[[int, GptOssArgs], nn.Module] = build_gpt_oss_block):
        super().__init__(args, build_block=build_block)

    def _rope_cache(self) -> torch.Tensor:
        args = self.args
        if args.yarn is None:
            return compute_rope_cache(args.head_dim, args.max_seq_len, args.rope_theta)
        return compute_yarn_rope_cache(args.head_dim, args.max_seq_len, args.rope_theta, args.yarn)
