"""DeepSeek-V4's attention: shared-KV multi-query attention over a sliding window, plus compressed entries.

Every layer attends to the last ``sliding_window`` tokens through one key/value head (the same tensor is key and
value), with a learned sink logit per query head, partial RoPE on the trailing ``rope_dim`` dims of each head (the
output's rope dims rotated back, so a value's contribution depends on the relative distance only), and a grouped
low-rank output projection. Two layer kinds add compressed entries to the keys:

* heavily-compressed (HCA): a ``Compressor`` pools each window of ``hca_rate`` tokens into one entry (a softmax over
  the window of learned gates plus a per-slot bias); query t sees the entries of windows that ended at or before t;
* compressed-sparse (CSA): entries every ``csa_rate`` tokens over overlapping windows of 2 * csa_rate tokens, of
  which each query sees only the ``index_topk`` its lightning ``Indexer`` scores best (among the finished ones).

transformers' ``DeepseekV4Attention`` computes the same; the math here follows it step for step so the logits agree
to rounding. The attention is explicit (bs, heads, queries, keys) scores: exact, memory O(n * (n + entries)).

Generation: ``state`` (None while training) is the seam ``components/generation/`` fills with a ``ContextState``;
the attention then appends the new tokens' key/values and its compressors' projections to it and attends over the
whole context, so a cached step computes exactly what a forward over the whole sequence does for those tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.attention import apply_sinks, masked_attention_with_lse
from torchtitan.models.common.init import trunc_normal_
from torchtitan.models.deepseek_v4.args import CSA, HCA, DeepSeekV4Args
from torchtitan.models.llama.model import apply_rotary_emb


class ContextState:
    """The projections of every token seen so far, by name, for generation (one per attention layer)."""

    def __init__(self):
        self.seen: dict[str, torch.Tensor] = {}

    def extend(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """new (bs, n, ...) appended to what ``name`` holds along dim 1 -> all of it (bs, length, ...)."""
        old = self.seen.get(name)
        self.seen[name] = new if old is None else torch.cat([old, new], dim=1)
        return self.seen[name]


def rotate_tail(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x (bs, n, heads, d) with its trailing rope_dim dims rotated by ``rope`` (n, rope_dim) [cos | sin] rows
    (interleaved pairs, transformers' V4 ``apply_rotary_pos_emb``); the leading dims are untouched."""
    rope_dim = rope.shape[-1]
    return torch.cat([x[..., :-rope_dim], apply_rotary_emb(x[..., -rope_dim:], rope)], dim=-1)


def conjugate(rope: torch.Tensor) -> torch.Tensor:
    """[cos | sin] rows -> [cos | -sin]: the inverse rotation."""
    cos, sin = rope.chunk(2, dim=-1)
    return torch.cat([cos, -sin], dim=-1)


def rms_norm_fp32(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """transformers' DeepseekV4RMSNorm: normalised and weighted in fp32, cast back once."""
    return norm(x.float()).to(x.dtype)


class Compressor(nn.Module):
    """Pools every ``rate`` tokens into one entry of ``head_dim``: a softmax over the window (per dim) of the gates
    plus a learned per-slot bias (``ape``), weighting the projected values; RMSNorm, then RoPE at the window's first
    position. ``overlap`` (CSA): each token projects two halves, and entry w pools window w-1's first halves with
    window w's second halves (width 2 * rate, stride rate; window 0's earlier half is empty).
    """

    def __init__(self, dim: int, head_dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        width = head_dim * (2 if overlap else 1)
        self.wkv = nn.Linear(dim, width, bias=False)
        self.wgate = nn.Linear(dim, width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, width))  # the gates' bias per slot of a window
        self.norm = nn.RMSNorm(head_dim, eps=eps)

    def init_weights(self) -> None:
        for linear in (self.wkv, self.wgate):
            trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.zeros_(self.ape)
        self.norm.reset_parameters()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, state: ContextState | None, name: str) -> torch.Tensor:
        """x (bs, n, dim) new tokens; rope (max_len, rope_dim) the compressed RoPE table -> (bs, W, head_dim): the
        entries of every finished window of the context (W = context length // rate)."""
        kv, gate = self.wkv(x), self.wgate(x)  # (bs, n, width)
        if state is not None:
            kv, gate = state.extend(f"{name}.kv", kv), state.extend(f"{name}.gate", gate)  # (bs, length, width)
        bs, windows, r, d = kv.shape[0], kv.shape[1] // self.rate, self.rate, self.head_dim
        if windows == 0:
            return kv.new_zeros(bs, 0, d)
        kv = kv[:, : windows * r].view(bs, windows, r, -1)  # (bs, W, rate, width)
        gate = gate[:, : windows * r].view(bs, windows, r, -1) + self.ape
        if self.overlap:  # (bs, W, 2 * rate, d): the previous window's first halves, then this window's second
            kv = torch.cat([_shift_windows(kv[..., :d], 0.0), kv[..., d:]], dim=2)
            gate = torch.cat([_shift_windows(gate[..., :d], float("-inf")), gate[..., d:]], dim=2)
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)  # (bs, W, d)
        pooled = rms_norm_fp32(self.norm, pooled)
        starts = torch.arange(windows, device=x.device) * r  # each entry's position: its window's first token
        return rotate_tail(pooled.unsqueeze(2), rope[starts]).squeeze(2)


def _shift_windows(t: torch.Tensor, fill: float) -> torch.Tensor:
    """(bs, W, rate, d) -> window w holds window w-1's rows; window 0 is ``fill``."""
    return torch.cat([torch.full_like(t[:, :1], fill), t[:, :-1]], dim=1)


class Indexer(nn.Module):
    """The lightning indexer of a compressed-sparse layer: its own compressor (at ``index_head_dim``) and query heads
    score every finished entry, sum_h w_h relu(q_h . k) with per-token head weights w; each query keeps its top
    ``index_topk``. Only the indices leave it, so (as in transformers) no gradient reaches its weights."""

    def __init__(self, args: DeepSeekV4Args):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.compressor = Compressor(args.dim, args.index_head_dim, args.csa_rate, True, args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(args.dim, args.index_n_heads, bias=False)

    def init_weights(self) -> None:
        self.compressor.init_weights()
        for linear in (self.wq_b, self.weights_proj):
            trunc_normal_(linear.weight, mean=0.0, std=0.02)

    def forward(
        self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor, state
    ) -> torch.Tensor:
        """x (bs, n, dim); q_latent (bs, n, q_lora_rank); positions (n,) -> (bs, n, W) bool: the entries each query
        keeps (finished ones only)."""
        bs, n, _ = x.shape
        keys = self.compressor(x, rope, state, "indexer")  # (bs, W, head_dim)
        finished = _finished(positions, keys.shape[1], self.compressor.rate)  # (n, W)
        if keys.shape[1] == 0:
            return finished.expand(bs, -1, -1)
        q = rotate_tail(self.wq_b(q_latent).view(bs, n, -1, self.head_dim), rope[positions])  # (bs, n, heads, d)
        scores = F.relu(q.float() @ keys.float().transpose(-1, -2).unsqueeze(1)) * self.head_dim**-0.5  # (bs,n,h,W)
        weights = self.weights_proj(x).float() * self.n_heads**-0.5  # (bs, n, heads)
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2).masked_fill(~finished, float("-inf"))  # (bs, n, W)
        top = scores.topk(min(self.topk, keys.shape[1]), dim=-1).indices  # (bs, n, k)
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True) & finished


def _finished(positions: torch.Tensor, windows: int, rate: int) -> torch.Tensor:
    """(n, W) bool: entry w's window (tokens w*rate .. (w+1)*rate - 1) has ended at or before each query's position."""
    return torch.arange(windows, device=positions.device) < ((positions + 1) // rate).unsqueeze(-1)


class V4Attention(nn.Module):
    """One layer's attention (see the module docstring); ``kind`` from ``args.layer_types``."""

    def __init__(self, layer_id: int, args: DeepSeekV4Args):
        super().__init__()
        self.kind = args.layer_types[layer_id]
        self.head_dim, self.window, self.o_groups, eps = (
            args.head_dim,
            args.sliding_window,
            args.o_groups,
            args.norm_eps,
        )
        self.norm_eps = eps
        self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=eps)
        self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * args.head_dim, bias=False)
        self.wkv = nn.Linear(args.dim, args.head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.head_dim, eps=eps)
        group_width = args.n_heads * args.head_dim // args.o_groups
        self.wo_a = nn.Linear(group_width, args.o_groups * args.o_lora_rank, bias=False)  # one block per group
        self.wo_b = nn.Linear(args.o_groups * args.o_lora_rank, args.dim, bias=False)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))
        rate = args.layer_rate(layer_id)
        self.compressor = Compressor(args.dim, args.head_dim, rate, self.kind == CSA, eps) if rate else None
        self.indexer = Indexer(args) if self.kind == CSA else None
        self.state: ContextState | None = None  # generation's seam (components/generation/)

    def new_state(self) -> ContextState:
        return ContextState()

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq_a, self.wq_b, self.wkv, self.wo_a):
            trunc_normal_(linear.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo_b.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.kv_norm):
            norm.reset_parameters()
        nn.init.zeros_(self.sinks)  # transformers' init
        for part in (self.compressor, self.indexer):
            if part is not None:
                part.init_weights()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (bs, n, dim); rope (2, max_len, rope_dim): the sliding and the compressed tables; positions (n,) of the
        new tokens, the last context ones (0.. while training) -> (bs, n, dim)."""
        bs, n, _ = x.shape
        table = rope[0] if self.compressor is None else rope[1]  # (max_len, rope_dim)
        at = table[positions]  # (n, rope_dim)
        q_latent = rms_norm_fp32(self.q_norm, self.wq_a(x))  # (bs, n, q_lora_rank)
        q = self.wq_b(q_latent).view(bs, n, -1, self.head_dim)  # (bs, n, n_heads, head_dim)
        q = rotate_tail(F.rms_norm(q, (self.head_dim,), eps=self.norm_eps), at)
        kv = rotate_tail(rms_norm_fp32(self.kv_norm, self.wkv(x)).unsqueeze(2), at).squeeze(2)  # (bs, n, head_dim)
        if self.state is not None:
            kv = self.state.extend("kv", kv)  # (bs, length, head_dim)
        keys = torch.arange(kv.shape[1], device=x.device)
        rel = positions.unsqueeze(-1) - keys  # (n, length)
        visible = ((rel >= 0) & (rel < self.window)).expand(bs, 1, -1, -1)  # (bs, 1, n, length)
        if self.compressor is not None:
            entries = self.compressor(x, table, self.state, "compressor")  # (bs, W, head_dim)
            if self.indexer is not None:
                kept = self.indexer(x, q_latent, positions, table, self.state)  # (bs, n, W)
            else:
                kept = _finished(positions, entries.shape[1], self.compressor.rate).expand(bs, -1, -1)
            kv = torch.cat([kv, entries], dim=1)
            visible = torch.cat([visible, kept.unsqueeze(1)], dim=-1)  # (bs, 1, n, length + W)
        out, lse = masked_attention_with_lse(q.transpose(1, 2), kv.unsqueeze(1), kv.unsqueeze(1), visible)
        out = apply_sinks(out, lse, self.sinks).to(x.dtype).transpose(1, 2)  # (bs, n, n_heads, head_dim)
        out = rotate_tail(out, conjugate(at))  # the values' rotation undone at the query's position
        grouped = out.reshape(bs, n, self.o_groups, -1)  # (bs, n, groups, group_width)
        w = self.wo_a.weight.view(self.o_groups, -1, grouped.shape[-1])  # (groups, o_lora_rank, group_width)
        low = torch.einsum("bngi,gri->bngr", grouped, w).flatten(2)  # (bs, n, groups * o_lora_rank)
        return self.wo_b(low)


__all__ = ["CSA", "HCA", "Compressor", "ContextState", "Indexer", "V4Attention"]
