"""Llama 3: RoPE, grouped-query attention, SwiGLU feed-forward, RMSNorm. A plain nn.Module.

This file knows nothing of parallelism. Attention reads the local head count from tensor shapes
(``view(bs, seqlen, -1, head_dim)``), so tensor parallel shards the projections without edits, and
``positions`` is an input, so context parallel can shard the sequence and pass each token's true
position. Submodules ``tok_embeddings``, ``norm`` and ``output`` may be None (pipeline stages that
do not own them), and ``layers`` is a ModuleDict keyed "0".."N-1" so names stay stable when a stage
drops layers.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.attention import (
    ATTENTION_BACKENDS,
    DocumentLayoutCache,
    block_causal_attention,
    repeat_kv,
)
from torchtitan.models.common.ends import ModelEnds
from torchtitan.models.common.init import trunc_normal_


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling (HF ``rope_scaling = {"rope_type": "llama3", ...}``).

    Rotation frequencies whose wavelength exceeds ``original_max_seq_len / low_freq_factor`` are
    divided by ``factor``; those with a wavelength below ``original_max_seq_len / high_freq_factor``
    are kept; in between, the two are blended linearly in ``original_max_seq_len / wavelength``.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    max_seq_len: int = 2048
    # depth_init: scale each block's output-projection init by its depth (True) or by the model depth.
    depth_init: bool = True
    norm_type: str = "rmsnorm"
    # block_causal kernel, "sdpa" or "flex" (models/common/attention.py); the config's "auto" is resolved
    # from the run's device before the model is built. Causal attention always runs SDPA.
    attention_backend: str = "sdpa"
    # The output head reuses the embedding table (Llama 3.2 1B/3B, small Qwen3): one parameter.
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_dict(cls, fields: dict) -> ModelArgs:
        """The args a checkpoint marker records (``dataclasses.asdict``), back as this class."""
        known = {f.name for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)  # a subclass's own field types (e.g. a YaRN rope_scaling)
        kwargs = {}
        for key, value in fields.items():
            if key not in known:
                continue
            if isinstance(value, dict):  # a nested dataclass (RoPE scaling), recorded as a dict
                nested = [t for t in typing.get_args(hints[key]) or (hints[key],) if dataclasses.is_dataclass(t)]
                value = nested[0](**value) if nested else value
            kwargs[key] = value
        return cls(**kwargs)


# fused_rmsnorm: torchtitan's name for the fused kernel, which torch 2.13's nn.RMSNorm already runs
# (F.rms_norm dispatches to aten::_fused_rms_norm on every device), so it builds the same module.
NORM_TYPES = ("rmsnorm", "fused_rmsnorm", "layernorm", "np_layernorm")


def build_norm(norm_type: str, dim: int, eps: float) -> nn.Module:
    if norm_type in ("rmsnorm", "fused_rmsnorm"):
        return nn.RMSNorm(dim, eps=eps)
    if norm_type == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=False)
    if norm_type == "np_layernorm":
        return nn.LayerNorm(dim, eps=eps, elementwise_affine=False, bias=False)
    raise ValueError(f"model.norm_type = {norm_type!r}: allowed are {', '.join(NORM_TYPES)}")


def compute_rope_cache(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """(max_seq_len, head_dim) holding [cos | sin] of each position's rotation angles."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # (head_dim/2,)
    if scaling is not None:
        freqs = scale_rope_freqs(freqs, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)  # (seq, head_dim/2)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def scale_rope_freqs(freqs: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling of the rotation frequencies (see ``RopeScaling``)."""
    ratio = scaling.original_max_seq_len * freqs / (2 * math.pi)  # original context / wavelength
    # 0 at or below the low-frequency bound (fully scaled), 1 at or above the high one (kept)
    keep = ((ratio - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0, 1)
    return (1 - keep) * freqs / scaling.factor + keep * freqs


def apply_rotary_emb(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of ``x`` (bs, seqlen, heads, head_dim) by ``rope`` (seqlen, head_dim),
    or per sequence (bs, seqlen, head_dim) when positions restart at each document.

    As one complex multiply per pair: (x[2i] + i x[2i+1]) (cos + i sin). It rounds exactly as the four real
    products and two sums it stands for (no fused multiply-add in torch's complex kernel), one kernel
    forward and one backward instead of seven each: ~3x faster on CPU (bench/rope.py).
    """
    cos, sin = rope.unsqueeze(-2).chunk(2, dim=-1)  # ([bs,] seqlen, 1, head_dim/2) each
    # a complex view needs each (real, imag) pair adjacent and aligned: a no-op for the projections' views, a copy
    # for a slice of a wider head (DeepSeek-V3's rope part)
    xf = x.float().contiguous()
    pairs = torch.view_as_complex(xf.unflatten(-1, (-1, 2)))  # (bs, seqlen, heads, head_dim/2)
    # float(): FSDP's bf16 policy casts the table to bf16 with the block's other inputs
    rotated = torch.view_as_real(pairs * torch.complex(cos.float(), sin.float()))  # (bs, seqlen, heads, head_dim/2, 2)
    return rotated.flatten(-2).type_as(x)


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v, a module so context parallel can swap in ring attention.

    Takes k and v with the (fewer) key/value heads: grouped-query heads are expanded here, after any
    communication, so a CP ring passes the compact tensors.

    Args:
        backend: the block-causal kernel, "sdpa" or "flex" (torchtitan/models/common/attention.py).
    """

    def __init__(self, backend: str = "sdpa"):
        super().__init__()
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend = {backend!r}: allowed are {', '.join(ATTENTION_BACKENDS)}")
        self.backend = backend
        # The Transformer replaces this with one cache shared by all its blocks (a plain attribute:
        # no state_dict entry), so a batch's document layout is computed once, not once per layer.
        self.documents = DocumentLayoutCache()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q (bs, n_heads, seqlen, head_dim); k, v (bs, n_kv_heads, seqlen, head_dim) -> like q.

        doc_ids (bs, seqlen): block-causal attention, each token sees its own document's past only
        (torchtitan/models/common/documents.py); None: plain causal.
        """
        if doc_ids is not None:
            return block_causal_attention(q, k, v, doc_ids, self.backend, self.documents)
        k, v = repeat_kv(k, v, q.shape[1] // k.shape[1])  # (bs, n_heads, seqlen, head_dim)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Grouped-query attention with RoPE; ``bias``: q/k/v/o projections with biases (gpt-oss)."""

    def __init__(self, args: ModelArgs, bias: bool = False):
        super().__init__()
        n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=bias)
        # families that reuse this module with args of their own (no document masking) run causal only
        self.sdpa: nn.Module = CausalAttention(getattr(args, "attention_backend", "sdpa"))
        # QK-norm (Qwen3): an RMSNorm over head_dim of each q and k head, before RoPE; None in Llama.
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x (bs, seqlen, dim); rope ([bs,] >= seqlen, head_dim), row i for the i-th token of x;
        doc_ids (bs, seqlen) or None: see CausalAttention."""
        bs, seqlen, _ = x.shape
        # -1: the local head count, which tensor parallel divides by the TP degree.
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_heads, head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_kv_heads, head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_kv_heads, head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # Sliced here, where the sequence is whole: between blocks, sequence parallel shards it.
        rope = rope[..., :seqlen, :]
        q, k = apply_rotary_emb(q, rope), apply_rotary_emb(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.attend(q, k, v, doc_ids)  # (bs, n_heads, seqlen, head_dim)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))  # (bs, seqlen, dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        """The kernel (``self.sdpa``, the seam CP and the KV cache swap) on (bs, heads, seqlen, head_dim) q, k, v;
        the documents only when given (a CP kernel takes them too)."""
        return self.sdpa(q, k, v) if doc_ids is None else self.sdpa(q, k, v, doc_ids=doc_ids)


def ffn_hidden_dim(args: ModelArgs) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim, times the multiplier, rounded up to multiple_of."""
    hidden = int(2 * (4 * args.dim) / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, hidden: int | None = None):
        """``hidden``: the SwiGLU width; default Llama's ``ffn_hidden_dim(args)``."""
        super().__init__()
        hidden = hidden or ffn_hidden_dim(args)
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm attention then feed-forward, each added to the residual stream.

    Args:
        feed_forward: the block's feed-forward (e.g. an MoE layer); default llama's FeedForward.
            Any module mapping (bs, seqlen, dim) -> (bs, seqlen, dim) with ``init_weights(init_std)``.
        attention: the block's attention (DeepSeek-V3's latent attention, gpt-oss's with sinks); default
            llama's. Any module called as ``attention(x, rope[, doc_ids=])`` with ``init_weights(init_std)``.
    """

    def __init__(
        self,
        layer_id: int,
        args: ModelArgs,
        feed_forward: nn.Module | None = None,
        attention: nn.Module | None = None,
    ):
        super().__init__()
        self.attention = attention if attention is not None else Attention(args)
        self.feed_forward = feed_forward if feed_forward is not None else FeedForward(args)
        self.attention_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.ffn_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        # doc_ids as a keyword: TP's PrepareModuleInput lays out the positional (x, rope) only
        h = x + (
            self.attention(self.attention_norm(x), rope)
            if doc_ids is None
            else self.attention(self.attention_norm(x), rope, doc_ids=doc_ids)
        )
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(ModelEnds, nn.Module):
    """Embedding, ``n_layers`` blocks, norm and output.

    Args:
        build_block: (layer_id, args) -> that layer's block; default llama's ``TransformerBlock``.
            A family with other blocks (e.g. MoE feed-forwards) passes its own and reuses the rest.
    """

    def __init__(self, args: ModelArgs, build_block: Callable[[int, ModelArgs], nn.Module] = TransformerBlock):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # Not persistent: recomputed by init_weights, never checkpointed.
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)
        self.layers = nn.ModuleDict({str(i): build_block(i, args) for i in range(args.n_layers)})
        self.document_cache = DocumentLayoutCache()  # shared by every block's kernel: one layout per batch
        for module in self.layers.modules():
            if isinstance(module, CausalAttention):
                module.documents = self.document_cache
        self.norm: nn.Module | None = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight  # (vocab, dim) both

    def rope_at(self, positions: torch.Tensor | None) -> torch.Tensor:
        """The RoPE table's rows for ``positions`` (None: the whole table, positions 0..)."""
        return self.rope_cache if positions is None else self.rope_cache[positions]

    def _rope_cache(self) -> torch.Tensor:
        args = self.args
        return compute_rope_cache(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)

    def init_units(self) -> Iterator[tuple[str, Callable[[], None]]]:
        """(name, init function) for each separately initialised unit this module still owns.

        The caller may reseed between units, so a pipeline stage that owns only some units draws
        the same values for them as the whole model does.
        """
        tied = self.args.tie_word_embeddings
        if self.tok_embeddings is not None:
            # a tied table is also the output head: initialised like it (std dim^-0.5), not N(0, 1)
            yield (
                "tok_embeddings",
                (
                    (lambda: self._init_head(self.tok_embeddings.weight))
                    if tied
                    else (lambda: nn.init.normal_(self.tok_embeddings.weight))
                ),
            )
        for name, block in self.layers.items():
            yield f"layers.{name}", block.init_weights
        if self.norm is not None:
            yield "norm", self.norm.reset_parameters
        if self.output is not None and not tied:
            yield "output", lambda: self._init_head(self.output.weight)

    def _init_head(self, weight: torch.Tensor) -> None:
        std = self.args.dim**-0.5
        trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Fill every parameter and buffer (after ``to_empty``) from the global RNG."""
        self.init_buffers(buffer_device)
        for _, init in self.init_units():
            init()

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """Recompute the RoPE table on ``buffer_device``; re-tie a tied output head first.

        ``to_empty`` gives each module its own new parameter where one was shared (FSDP2 keeps the
        sharing itself), so the head takes the embedding's parameter again here, before any init.
        """
        if self.args.tie_word_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight
        device = buffer_device or self.rope_cache.device
        with torch.device(device):
            self.rope_cache = self._rope_cache()

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        doc_ids: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """tokens (bs, seqlen) -> logits (bs, seqlen, vocab); on a middle pipeline stage, hidden -> hidden. Floating
        ``tokens`` are taken as already embedded (bs, seqlen, dim): a multimodal wrapper's, image features placed.

        positions (seqlen,) are the tokens' positions in their sequence (default 0..seqlen-1), or
        (bs, seqlen) positions inside each token's document (model.positions_per_document).
        doc_ids (bs, seqlen): block-causal attention over these documents (None: causal); the
        trainer passes both through forward pre-hooks (torchtitan/models/common/documents.py).
        return_hidden: return the normed hidden state (bs, seqlen, dim) and skip ``output``, for a
        loss that applies the output projection itself (torchtitan.components.loss).
        """
        embedded = self.tok_embeddings is None or tokens.is_floating_point()  # a later stage's, or a wrapper's
        h = tokens if embedded else self.tok_embeddings(tokens)  # (bs, seqlen, dim)
        rope = self.rope_at(positions)  # ([bs,] seqlen, head_dim)
        for layer in self.layers.values():
            h = layer(h, rope) if doc_ids is None else layer(h, rope, doc_ids=doc_ids)
        h = self.norm(h) if self.norm is not None else h
        if return_hidden:
            return h  # (bs, seqlen, dim)
        return self.output(h) if self.output is not None else h  # (bs, seqlen, vocab)
