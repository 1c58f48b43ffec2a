"""DeepSeek Sparse Attention (DSA): the lightning indexer, its top-k key selection, the sparse kernel and the
indexer's KL loss.

The indexer scores every (query s, key t) pair cheaply: ``I[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] * d^-0.5)``
over ``index_n_heads`` small heads, with one shared key per token (``wk`` then a LayerNorm) and a per-query head
weight (``weights_proj``, times ``index_n_heads^-0.5``); RoPE rotates the first ``qk_rope_head_dim`` dims of q and k
as halves (transformers' DeepseekV32Indexer; the main attention rotates pairs). Each query then attends, in the
main MLA, to the ``index_topk`` causal keys of highest score (every causal key while there are fewer).

The indexer's loss (DeepSeek-V3.2's paper, its continued pre-training): the target is the main attention's distribution, summed
over its heads and L1-normalised (each head's sums to 1, so a mean over heads), detached; the loss is
``KL(p_s || softmax(I_s))`` per query, over the selected keys in the sparse stage and over every causal key in the
dense warm-up, averaged over the queries. The indexer reads detached inputs, so this loss trains the indexer
alone, and the LM loss (which cannot reach it through the non-differentiable top-k) trains the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.init import trunc_normal_
from torchtitan.models.deepseek_v32.args import DeepSeekV32Args
from torchtitan.models.qwen3_5.model import apply_partial_rope


class Indexer(nn.Module):
    """The lightning indexer's projections: (x, the q latent, RoPE rows) -> its queries, keys and head weights."""

    def __init__(self, args: DeepSeekV32Args):
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.wq_b = nn.Linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(args.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(args.dim, args.index_n_heads, bias=False)

    def init_weights(self) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            trunc_normal_(linear.weight, mean=0.0, std=0.02)
        self.k_norm.reset_parameters()

    def forward(
        self, x: torch.Tensor, q_latent: torch.Tensor, rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (bs, n, dim), q_latent (bs, n, q_lora_rank), rope ([bs,] n, qk_rope_head_dim) -> q (bs, n, heads,
        head_dim), k (bs, n, head_dim), w (bs, n, heads) fp32 times heads^-0.5."""
        bs, n, _ = x.shape
        q = self.wq_b(q_latent).view(bs, n, self.n_heads, self.head_dim)  # (bs, n, heads, head_dim)
        q = apply_partial_rope(q, rope)
        k = apply_partial_rope(self.k_norm(self.wk(x)).unsqueeze(2), rope).squeeze(2)  # (bs, n, head_dim)
        w = self.weights_proj(x).float() * self.n_heads**-0.5  # (bs, n, heads)
        return q, k, w


def compute_index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q (bs, n, heads, d), k (bs, T, d), w (bs, n, heads) -> I (bs, n, T) = sum_h w * relu(q_h . k * d^-0.5), fp32.

    In transformers' order of operations (scale after the product), so near-ties at the top-k's edge round alike."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * q.shape[-1] ** -0.5
    scores = F.relu(scores)  # (bs, n, heads, T)
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # (bs, n, T)


def select_top_k(scores: torch.Tensor, allowed: torch.Tensor, top_k: int) -> torch.Tensor:
    """The keys each query attends to: its ``top_k`` allowed keys of highest score (all while fewer are allowed).

    scores (bs, n, T), allowed (bs or 1, n, T) bool -> keep (bs, n, T) bool."""
    masked = scores.detach().masked_fill(~allowed, float("-inf"))
    chosen = masked.topk(min(top_k, scores.shape[-1]), dim=-1).indices  # (bs, n, k); some -inf while few allowed
    return torch.zeros_like(masked, dtype=torch.bool).scatter(-1, chosen, True) & allowed


def causal_allowed(n: int, start: int, doc_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(1 or bs, n, start + n) bool: query i (position start + i) may see keys 0..start + i (of its document)."""
    allowed = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(diagonal=start).unsqueeze(0)
    if doc_ids is not None:  # (bs, seqlen), the whole sequence (no cache)
        allowed = allowed & (doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2))
    return allowed


def compute_indexer_loss(scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """mean over queries of KL(p || softmax(I)) over the kept keys; p the main attention's distribution over
    them (mean of its heads'), detached.

    scores (bs, n, T) with a graph to the indexer; q (bs, heads, n, d) scaled as the kernel's input, k (bs, heads,
    T, d); keep (bs, n, T) bool."""
    with torch.no_grad():
        logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # (bs, heads, n, T)
        p = logits.masked_fill(~keep.unsqueeze(1), float("-inf")).softmax(dim=-1).mean(dim=1)  # (bs, n, T)
    log_q = scores.masked_fill(~keep, float("-inf")).log_softmax(dim=-1).masked_fill(~keep, 0.0)
    return (torch.xlogy(p, p) - p * log_q).sum(dim=-1).mean()


class SparseAttention(nn.Module):
    """The kernel seam of DSA's attention (``attention.sdpa``): the indexer's top-k keys, then softmax attention
    over them; the indexer's loss of the last training forward in ``indexer_loss``.

    ``stage``: "sparse" or "dense_warmup" (dense causal attention; the loss over every causal key).
    """

    def __init__(self, top_k: int, stage: str):
        super().__init__()
        self.top_k, self.stage = top_k, stage
        self.indexer_loss: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (bs, heads, n, qk_head_dim), k like q, v (bs, heads, n, v_head_dim); index: the indexer's (q, k, w);
        doc_ids (bs, n) or None -> (bs, heads, n, v_head_dim)."""
        allowed = causal_allowed(q.shape[2], 0, doc_ids, q.device)
        scores = compute_index_scores(*index)  # (bs, n, n)
        keep = allowed.expand_as(scores) if self.stage == "dense_warmup" else select_top_k(scores, allowed, self.top_k)
        if torch.is_grad_enabled():  # training: only training back-propagates it
            loss = compute_indexer_loss(scores, q, k, keep)
            # Kept only from a forward the autograd engine is not running: activation checkpointing's recompute (in
            # backward; computed all the same, so it saves the tensors the first forward saved) would keep the
            # recomputed graph alive until the next forward (as MoE's aux loss).
            if torch._C._current_graph_task_id() == -1:
                self.indexer_loss = loss
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep.unsqueeze(1))

    def cached(self, cache) -> CachedSparseAttention:
        """Its KV-cache twin (components/generation/ ``KVCache.install``)."""
        return CachedSparseAttention(cache, self.top_k)


class CachedSparseAttention(nn.Module):
    """``SparseAttention`` of new queries over cached + new keys: the indexer's keys cached beside the main ones.

    ``cache``: the generation's ``KVCache`` (``length`` filled of ``max_len``)."""

    def __init__(self, cache, top_k: int):
        super().__init__()
        self.cache, self.top_k = cache, top_k
        self.k: torch.Tensor | None = None  # (bs, heads, max_len, qk_head_dim)
        self.v: torch.Tensor | None = None  # (bs, heads, max_len, v_head_dim)
        self.index_k: torch.Tensor | None = None  # (bs, max_len, index_head_dim)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        start, n = self.cache.length, q.shape[2]
        index_q, index_k, index_w = index
        if self.k is None:
            self.k = k.new_zeros((*k.shape[:2], self.cache.max_len, k.shape[3]))
            self.v = v.new_zeros((*v.shape[:2], self.cache.max_len, v.shape[3]))
            self.index_k = index_k.new_zeros((index_k.shape[0], self.cache.max_len, index_k.shape[2]))
        self.k[:, :, start : start + n], self.v[:, :, start : start + n] = k, v
        self.index_k[:, start : start + n] = index_k
        scores = compute_index_scores(index_q, self.index_k[:, : start + n], index_w)  # (bs, n, start + n)
        keep = select_top_k(scores, causal_allowed(n, start, None, q.device), self.top_k)
        keys, values = self.k[:, :, : start + n], self.v[:, :, : start + n]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=keep.unsqueeze(1))
