"""Gated DeltaNet, Qwen3.5's linear-attention layer (Yang et al. 2024), in torch.

Per value head a state S (k_dim, v_dim) is carried along the sequence. At each token t, with a decay
a_t = exp(g_t) in (0, 1] and a write strength beta_t in (0, 1):

    S <- a_t S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

(the delta rule: the state's own prediction of v_t is corrected, not added to). q and k are L2-normalised
per head, q scaled by k_dim^-0.5. ``recurrent_gated_delta_rule`` is that loop (generation, and the
reference); ``chunked_gated_delta_rule`` computes the same outputs ``chunk`` tokens at a time (training): inside
a chunk the corrections are the solution of a unit lower-triangular system (the "UT transform"), between
chunks the state is passed on. The layer around it (``GatedDeltaNet``): one fused q/k/v projection, a depthwise
causal convolution of width ``conv_kernel`` over it (SiLU), the decay from ``A_log`` and ``dt_bias``, beta from
its own projection, an RMSNorm of each head's output gated by SiLU(z), and the output projection.

Documents (``doc_ids``): neither the state nor the convolution crosses a document boundary: each document
runs from a zero state and zero convolution history, as if alone. Masks built from the ids do it inside the
batched computation (no host read, no per-document loop), so a compiled block (fullgraph) and the memory
estimator's fake tensors run the same code as eager training.

Generation (``GatedDeltaNet.state``, a ``RecurrentState``): while one is set, each call continues the sequence of
the previous calls: the convolution reads the last ``conv_kernel - 1`` inputs kept from them and the rule starts
from their final state, so a prompt then one token at a time gives what one forward over the whole sequence gives
(components/generation/ sets it beside the attention's KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.init import trunc_normal_
from torchtitan.models.common.local import local_part


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (transformers' and flash-linear-attention's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def repeat_to_value_heads(q: torch.Tensor, k: torch.Tensor, value_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """q and k with each of their heads (along ``dim``) repeated for the ``value_heads / heads`` consecutive value
    heads it serves."""
    rep = value_heads // k.shape[dim]
    if rep == 1:
        return q, k
    return q.repeat_interleave(rep, dim=dim), k.repeat_interleave(rep, dim=dim)


def _heads_first(q, k, v, g, beta):
    """(bs, T, H, d) / (bs, T, H) -> fp32 (bs, H, T, d) / (bs, H, T); k/q heads repeated to the value heads;
    q and k L2-normalised, q scaled by d^-0.5."""
    q, k, v = (x.transpose(1, 2).float().contiguous() for x in (q, k, v))  # (bs, H, T, d)
    q, k = repeat_to_value_heads(q, k, v.shape[1], dim=1)
    g, beta = (x.transpose(1, 2).float().contiguous() for x in (g, beta))
    q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q, k (bs, T, Hk, dk); v (bs, T, H, dv); g (log decay, <= 0), beta (bs, T, H); state
    (bs, H, dk, dv) or None (zero) -> (out (bs, T, H, dv) in v's dtype, the final state, fp32)."""
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    bs, heads, length, dk = k.shape
    s = q.new_zeros(bs, heads, dk, v.shape[-1]) if state is None else state.float()
    out = []
    for t in range(length):
        s = s * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (s * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]  # (bs, H, dv)
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        out.append((s * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, dim=1).to(dtype), s


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = 64,
    state: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk`` tokens at a time; the arguments and results of ``recurrent_gated_delta_rule``, and ``doc_ids``
    (bs, T): each document from a zero state, as if alone (masks, no host read: it traces under compile).

    Within a chunk, with G the cumulative log decay and D[i, j] = exp(G_i - G_j) for j <= i (else 0):
    the corrections u solve (I + strictly_lower((beta k) k^T * D)) u = beta v - (beta k exp(G)) S, split as
    u = U - W S with U, W solved once for every chunk; then o = (q exp(G)) S + ((q k^T) * D) u and
    S <- exp(G_last) S + (k exp(G_last - G))^T u. With documents D is zero across them, only the tokens of the
    document the state belongs to read it, only the chunk's last document writes it, and a chunk with a new
    document does not pass the state on.
    """
    dtype, length = v.dtype, v.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    bs, heads, _, dk = k.shape
    pad = -length % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    q, k, v = (x.unflatten(2, (-1, chunk)) for x in (q, k, v))  # (bs, H, N, C, d)
    g, beta = (x.unflatten(2, (-1, chunk)) for x in (g, beta))  # (bs, H, N, C)
    cum = g.cumsum(-1)
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # j > i: no decay, no attention
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()  # (bs, H, N, C, C)
    reads, writes, passes = 1.0, 1.0, 1.0
    if doc_ids is not None:
        same, reads, writes, passes = _document_masks(doc_ids, chunk, pad)
        decay = decay * same
    kb = k * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * decay
    solve = dict(upper=False, unitriangular=True)  # the diagonal is taken as 1: (I + strictly lower)
    u0 = torch.linalg.solve_triangular(system, v * beta[..., None], **solve)
    w = torch.linalg.solve_triangular(system, kb * (cum.exp() * reads)[..., None], **solve)
    inner = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * (cum.exp() * reads)[..., None]
    k_to_end = k * ((cum[..., -1:] - cum).exp() * writes)[..., None]
    chunk_decay = (cum[..., -1].exp() * passes)[..., None, None]  # (bs, H, N, 1, 1)
    s = q.new_zeros(bs, heads, dk, v.shape[-1]) if state is None else state.float()
    out = []
    for n in range(q.shape[2]):
        u = u0[:, :, n] - w[:, :, n] @ s
        out.append(q_decayed[:, :, n] @ s + inner[:, :, n] @ u)
        s = s * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ u
    o = torch.stack(out, dim=2).flatten(2, 3)[:, :, :length]  # (bs, H, T, dv)
    return o.transpose(1, 2).to(dtype), s


def _document_masks(doc_ids: torch.Tensor, chunk: int, pad: int) -> tuple[torch.Tensor, ...]:
    """doc_ids (bs, T) -> fp32 masks for the chunked rule, broadcasting over heads: ``same`` (bs, 1, N, C, C) token
    pairs of one document; ``reads`` (bs, 1, N, C) tokens of the document the incoming state holds (that of the
    token before the chunk); ``writes`` tokens of the chunk's last document; ``passes`` (bs, 1, N) chunks whose
    incoming state's document runs to their end. Documents are contiguous: equal ids, no boundary between."""
    ids = F.pad(doc_ids, (0, pad), mode="replicate") if pad else doc_ids  # the padding joins the last document
    ids = ids.unflatten(1, (-1, chunk))[:, None]  # (bs, 1, N, C)
    before = torch.cat([ids[..., :1, :1], ids[..., :-1, -1:]], dim=2)  # (bs, 1, N, 1): the token before each chunk
    same = (ids[..., :, None] == ids[..., None, :]).float()
    reads = (ids == before).float()
    writes = (ids == ids[..., -1:]).float()
    return same, reads, writes, (ids[..., -1] == before[..., 0]).float()


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """x (bs, T, C), weight (C, K) -> SiLU of each channel's causal convolution (bs, T, C): output t sees
    inputs t-K+1..t, zeros before the start; with ``doc_ids`` (bs, T), only those of its own document."""
    width, length = weight.shape[-1], x.shape[1]
    if doc_ids is None:
        out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), padding=width - 1, groups=weight.shape[0])
        return F.silu(out[..., :length]).transpose(1, 2)
    out = x * weight[:, -1]  # tap 0: the token itself
    for back in range(1, width):  # input t - back, where it is in t's document
        earlier = F.pad(x, (0, 0, back, 0))[:, :length]
        same = F.pad(doc_ids, (back, 0), value=-1)[:, :length] == doc_ids  # (bs, T)
        out = out + earlier * weight[:, width - 1 - back] * same[..., None].to(x.dtype)
    return F.silu(out)


@dataclass
class RecurrentState:
    """One Gated DeltaNet layer's state between calls: its convolution's last inputs (bs, conv_kernel - 1, C) and
    the rule's state (bs, H, dk, dv) in fp32; None before the first call (zeros)."""

    conv: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (fp32), times its weight, times SiLU(z) (the gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer; its submodule names are transformers' (``in_proj_qkv``, ``conv1d``...).

    ``in_proj_qkv``'s rows (and ``conv1d``'s channels) are grouped by key head: per key head its query, its key
    and the values of the value heads it serves (transformers stores all queries, then all keys, then all values;
    the HF adapter reorders). So a tensor-parallel rank's contiguous rows are whole groups, and the layer reads its
    local head counts from shapes; per-head parameters (``A_log``, ``dt_bias``, the convolution) go through
    ``local_part`` (a tensor-parallel plan shards them over heads as DTensors).

    Args:
        dim: the model width; key_heads / value_heads, key_dim / value_dim: the linear attention's heads and
            their sizes (value heads a multiple of key heads); conv_kernel: the convolution's width;
            chunk: the chunked rule's chunk length; eps: the gated norm's.
    """

    def __init__(
        self,
        dim: int,
        key_heads: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        conv_kernel: int,
        chunk: int,
        eps: float,
    ):
        super().__init__()
        self.key_dim, self.value_dim, self.chunk = key_dim, value_dim, chunk
        keys, values = key_heads * key_dim, value_heads * value_dim
        self.split = (key_dim, key_dim, values // key_heads)  # one key head's group: query, key, its values
        self.in_proj_qkv = nn.Linear(dim, 2 * keys + values, bias=False)
        self.in_proj_z = nn.Linear(dim, values, bias=False)
        self.in_proj_b = nn.Linear(dim, value_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, value_heads, bias=False)
        self.conv1d = nn.Conv1d(2 * keys + values, 2 * keys + values, conv_kernel, groups=2 * keys + values, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(value_heads))
        self.A_log = nn.Parameter(torch.zeros(value_heads))
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = nn.Linear(values, dim, bias=False)
        self.state: RecurrentState | None = None  # generation's: set, each call continues the last one
        # the chunked rule's kernel: this torch form, or one with its contract (features/linear_attention: fla's)
        self.chunk_rule = chunked_gated_delta_rule

    @staticmethod
    def new_state() -> RecurrentState:
        """An empty state for ``state`` (generation sets it; the first call starts from zeros)."""
        return RecurrentState()

    def init_weights(self, init_std: float) -> None:
        for linear in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a):
            trunc_normal_(linear.weight, mean=0.0, std=0.02)
        trunc_normal_(self.out_proj.weight, mean=0.0, std=init_std)
        self.conv1d.reset_parameters()
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():  # per-head decay rates A in [0.01, 16] (log-uniform would be as good)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        self.norm.reset_parameters()

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None):
        """x (bs, T, dim) -> (bs, T, dim); ``rope`` is not used (the block's signature); doc_ids (bs, T): each
        document from a zero state and convolution history."""
        mixed = self.in_proj_qkv(x)  # (bs, T, 2 keys + values)
        z = self.in_proj_z(x).unflatten(-1, (-1, self.value_dim))  # (bs, T, H, dv)
        beta = self.in_proj_b(x).sigmoid()  # (bs, T, H)
        decay, bias = local_part(self.A_log).float().exp(), local_part(self.dt_bias)  # (H,) this rank's heads
        g = -decay * F.softplus(self.in_proj_a(x).float() + bias)  # (bs, T, H), <= 0
        weight = local_part(self.conv1d.weight).squeeze(1)  # (C, K)
        if self.state is not None:
            out = self._continue(mixed, weight, g, beta, self.state)
        else:
            out = self._mix(mixed, weight, g, beta, doc_ids)
        return self.out_proj(self.norm(out, z).flatten(2))  # the norm per head

    def _heads(self, convolved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output (bs, T, key-head groups) -> q, k (bs, T, Hk, dk), v (bs, T, H, dv)."""
        q, k, v = convolved.unflatten(-1, (-1, sum(self.split))).split(self.split, dim=-1)  # (bs, T, Hk, .)
        return q, k, v.reshape(*v.shape[:2], -1, self.value_dim)

    def _mix(self, mixed, weight, g, beta, doc_ids=None):
        """The convolution and the chunked rule over whole rows (each document alone) -> (bs, T, H, dv)."""
        q, k, v = self._heads(causal_depthwise_conv(mixed, weight, doc_ids))
        documents = {} if doc_ids is None else {"doc_ids": doc_ids}
        return self.chunk_rule(q, k, v, g, beta, self.chunk, **documents)[0]

    def _continue(self, mixed, weight, g, beta, state: RecurrentState):
        """``_mix`` continuing the calls before (generation): the convolution over the kept inputs then these, the
        rule from the kept state (token by token for fewer tokens than a chunk); both kept for the next call."""
        kept = weight.shape[-1] - 1
        history = state.conv if state.conv is not None else mixed.new_zeros(mixed.shape[0], kept, mixed.shape[2])
        inputs = torch.cat([history, mixed], dim=1)  # (bs, kept + T, C)
        q, k, v = self._heads(causal_depthwise_conv(inputs, weight)[:, kept:])
        rule = recurrent_gated_delta_rule if mixed.shape[1] < self.chunk else self.chunk_rule
        chunk = {} if mixed.shape[1] < self.chunk else {"chunk": self.chunk}
        out, state.recurrent = rule(q, k, v, g, beta, state=state.recurrent, **chunk)
        state.conv = inputs[:, inputs.shape[1] - kept :]
        return out
