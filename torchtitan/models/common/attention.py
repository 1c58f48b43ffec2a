"""Block-causal attention kernels (``model.attn_mask_type = "block_causal"``), by ``model.attention_backend``.

Each token attends to the earlier tokens of its own document only (torchtitan/models/common/documents.py).
A boolean mask over the whole window says that, but makes SDPA compute (and on CPU, materialise)
every query-key pair of the window. The backends skip the pairs across documents instead:

- ``sdpa``: one causal SDPA call per document. Measured on CPU (bs 2, 8 heads, head_dim 64,
  seqlen 2048, 16 documents of 128, forward + backward): 0.073 s against 0.71 s for SDPA with the
  mask and 0.51 s for plain causal SDPA over the window. Runs everywhere.
- ``flex``: FlexAttention with a BlockMask, which skips whole 128x128 blocks outside the documents
  in one fused kernel. CUDA only for training: torch 2.13 has no FlexAttention backward on CPU.

The document layout a backend needs (host-side lengths, or a BlockMask) depends only on the batch,
so it is computed once per forward and shared by every layer (``DocumentLayoutCache``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from torchtitan.models.common.documents import block_causal_mask

ATTENTION_BACKENDS = ("sdpa", "flex")  # what the model runs; the config's "auto" resolves to one


def resolve_attention_backend(requested: str, device_type: str) -> str:
    """``model.attention_backend`` -> the backend the model runs on ``device_type`` ("sdpa" or "flex").

    Raises:
        ValueError: an unknown backend, or "flex" where it cannot train (not CUDA).
    """
    if requested == "auto":
        return "flex" if device_type == "cuda" else "sdpa"  # device-choice: FlexAttention's backward
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"model.attention_backend = {requested!r}: allowed are 'auto', {', '.join(map(repr, ATTENTION_BACKENDS))}"
        )
    if requested == "flex" and device_type != "cuda":  # device-choice: FlexAttention's backward
        raise ValueError(
            "model.attention_backend = 'flex' needs CUDA: torch 2.13 has no FlexAttention backward on CPU; "
            "use 'sdpa' or 'auto'"
        )
    return requested


class DocumentLayoutCache:
    """The document layout of each live batch, shared by every attention kernel of one model.

    The Transformer creates one and hands it to its blocks. Within a forward every layer gets the
    same ``doc_ids`` tensor object, and activation-checkpoint recompute passes it again, so an
    identity check finds it; its version counter catches an in-place edit. A layout is kept while its
    ``doc_ids`` tensor lives (a weak reference drops it after), for every micro-batch in flight: a
    pipeline schedule runs several micro-batches' forwards before their backwards, and op-level
    activation checkpointing refuses a recompute that runs ops its forward did not (a layout computed
    again because a later micro-batch replaced it). It also holds the compiled FlexAttention
    functions, built on first use.
    """

    def __init__(self) -> None:
        self.num_computed = 0  # layouts computed so far (one per batch when the cache works)
        self._layouts: dict[int, tuple[weakref.ref, int, dict[str, Any]]] = {}  # id -> (tensor, version, kinds)
        self._compiled: dict[Callable, Callable] = {}

    def get(self, doc_ids: torch.Tensor, kind: str, compute: Callable[[torch.Tensor], Any]) -> Any:
        """``compute(doc_ids)``, or the layout of this ``kind`` computed before for this very tensor."""
        key = id(doc_ids)
        entry = self._layouts.get(key)
        if entry is None or entry[0]() is not doc_ids or entry[1] != doc_ids._version:
            layouts = self._layouts
            entry = (weakref.ref(doc_ids, lambda _: layouts.pop(key, None)), doc_ids._version, {})
            layouts[key] = entry
        if kind not in entry[2]:
            entry[2][kind] = compute(doc_ids)
            self.num_computed += 1
        return entry[2][kind]

    def compiled(self, fn: Callable) -> Callable:
        """``torch.compile(fn)``, made on first use (dynamo's code cache is shared by every model anyway)."""
        if fn not in self._compiled:
            self._compiled[fn] = torch.compile(fn)
        return self._compiled[fn]


def repeat_kv(k: torch.Tensor, v: torch.Tensor, n_rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v (bs, n_kv_heads, seqlen, head_dim) with each head repeated ``n_rep`` times (grouped-query
    attention), as they are when ``n_rep`` is 1: no copy per layer where every query head has its own."""
    if n_rep == 1:
        return k, v
    return k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)  # (bs, n_heads, seqlen, head_dim)


def document_lengths(doc_ids: torch.Tensor) -> list[int]:
    """(bs, seqlen) document ids -> every document's length, row after row (they sum to bs * seqlen).

    Reads the ids on the host (one sync per batch). A document is a run of equal ids: ids never
    decrease along a row (documents.document_ids), and rows are offset so none runs into the next.
    """
    bs, seqlen = doc_ids.shape
    offset = torch.arange(bs, device=doc_ids.device)[:, None] * seqlen  # ids are < seqlen
    _, counts = torch.unique_consecutive((doc_ids + offset).flatten(), return_counts=True)
    return counts.tolist()


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Block-causal attention as one causal SDPA call per document.

    q (bs, n_heads, seqlen, head_dim); k, v (bs, n_kv_heads, seqlen, head_dim); ``lengths`` from
    ``document_lengths`` -> (bs, n_heads, seqlen, head_dim).
    """
    bs, _, seqlen, _ = q.shape
    # Token-major, rows after each other: (bs * seqlen, heads, head_dim). Documents are then
    # consecutive chunks of dim 0, so one split per tensor (backward: one cat) and one cat of the
    # outputs, where slicing would add a full-size zero gradient per document.
    chunks = [t.transpose(1, 2).flatten(0, 1).split(lengths) for t in (q, k, v)]  # (n, heads, head_dim) each
    outs = [_causal_sdpa(*document) for document in zip(*chunks)]
    out = torch.cat(outs).unflatten(0, (bs, seqlen))  # (bs, seqlen, n_heads, head_dim)
    return out.transpose(1, 2)  # (bs, n_heads, seqlen, head_dim), a view the caller transposes back


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One document: q (n, n_heads, head_dim); k, v (n, n_kv_heads, head_dim) -> like q."""
    # SDPA wants (1, heads, n, head_dim): 4-D, else CPU SDPA takes its math path, which materialises
    # the (n, n) scores. k and v keep their fewer heads: the kernel expands them (GQA; on CUDA only
    # FlashAttention does, so an fp32 GQA model there runs the math path per document).
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)


def document_mask_mod(doc_ids: torch.Tensor) -> Callable:
    """FlexAttention's mask_mod for ``doc_ids`` (bs, seqlen): causal and within the same document."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return mask_mod


def build_document_block_mask(doc_ids: torch.Tensor, build: Callable = create_block_mask) -> BlockMask:
    """(bs, seqlen) document ids -> a BlockMask for every head (H=None: TP's local heads share it).

    ``build``: ``create_block_mask``, or a compiled one, which computes the blocks without
    materialising a (bs, seqlen, seqlen) mask on the way.
    """
    bs, seqlen = doc_ids.shape
    return build(document_mask_mod(doc_ids), B=bs, H=None, Q_LEN=seqlen, KV_LEN=seqlen, device=doc_ids.device)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """Block-causal attention as SDPA with a (bs, 1, seqlen, seqlen) boolean mask: the reference."""
    k, v = repeat_kv(k, v, q.shape[1] // k.shape[1])  # (bs, n_heads, seqlen, head_dim)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(doc_ids, doc_ids))


def block_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, backend: str, cache: DocumentLayoutCache
) -> torch.Tensor:
    """q (bs, n_heads, seqlen, head_dim); k, v (bs, n_kv_heads, seqlen, head_dim); doc_ids (bs, seqlen) -> like q."""
    if torch.compiler.is_compiling():
        return _traced_block_causal(q, k, v, doc_ids, backend)
    if is_fake(doc_ids):
        return _fake_block_causal(q, k, v, doc_ids, backend)
    if backend == "flex":
        block_mask = cache.get(
            doc_ids, "block_mask", lambda ids: build_document_block_mask(ids, cache.compiled(create_block_mask))
        )
        return cache.compiled(flex_attention)(q, k, v, block_mask=block_mask, enable_gqa=True)
    return split_attention(q, k, v, cache.get(doc_ids, "lengths", document_lengths))


def _traced_block_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, backend: str
) -> torch.Tensor:
    """Inside a compiled block (training.compile, fullgraph): nothing may read the ids on the host.

    flex: the block mask is built in the graph, per layer (cheap next to the attention), since a
    cache on a Python object does not carry across compiled calls. sdpa: the split needs host-side
    lengths, so compiled blocks run the boolean mask (computing every pair of the window).
    """
    if backend == "flex":
        return flex_attention(q, k, v, block_mask=build_document_block_mask(doc_ids), enable_gqa=True)
    return masked_attention(q, k, v, doc_ids)


def _fake_block_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, backend: str
) -> torch.Tensor:
    """Under fake tensors (the memory estimator) the ids cannot be read: one document per row stands in.

    The memory does not depend on the document count. The split keeps each document's output and
    logsumexp for backward plus their concatenation: with one document per row, the same bytes.
    The fused flex kernel keeps one output and logsumexp, as causal SDPA over the window does
    (FlashAttention, where the estimate runs on CUDA in bf16/fp16).
    """
    if backend == "flex":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    bs, seqlen = doc_ids.shape
    return split_attention(q, k, v, [seqlen] * bs)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention ``out`` (bs, heads, sq, head_dim) with logsumexp ``lse`` (bs, heads, sq) of its scores, corrected
    as if each head's ``sinks`` (heads,) logit had joined the softmax denominator (and its value were 0).

    Exact: with Z = sum_j exp(s_j) = exp(lse), the sink's softmax gives weights exp(s_j) / (Z + exp(sink)), so
        out_sink = out * Z / (Z + exp(sink)) = out / (1 + exp(sink - lse)) = out * sigmoid(lse - sink).
    Blockwise kernels (ring attention) merge blocks into (out, lse) first and apply this once, at the end.
    """
    gate = torch.sigmoid(lse.float() - sinks.float().view(-1, 1))  # (bs, heads, sq)
    return out * gate.unsqueeze(-1).to(out.dtype)


def masked_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(head_dim), masked) v, and the logsumexp of each row's visible scores; fp32.

    q (bs, n_heads, sq, head_dim); k, v (bs, n_kv_heads, sk, head_dim); mask (sq, sk) or (bs, 1, sq, sk), every
    row seeing at least one key -> out (bs, n_heads, sq, head_dim), lse (bs, n_heads, sq). The explicit (sq, sk)
    scores: exact and differentiable in both outputs on every device, memory O(sq * sk) per head (gpt-oss's
    sink kernel; the KV cache's sink path).
    """
    bs, n_heads, s, head_dim = q.shape
    n_kv_heads, sk = k.shape[1], k.shape[2]
    # query head h uses kv head h // n_rep (transformers' repeat_kv): group the query heads per kv head
    qg = q.float().view(bs, n_kv_heads, n_heads // n_kv_heads, s, head_dim)  # (bs, hkv, n_rep, s, d)
    scores = qg @ k.float().unsqueeze(2).transpose(-1, -2) * head_dim**-0.5  # (bs, hkv, n_rep, s, sk)
    scores = scores.flatten(1, 2).masked_fill(~mask, float("-inf"))  # (bs, n_heads, s, sk)
    lse = scores.logsumexp(dim=-1)  # (bs, n_heads, s)
    probs = (scores - lse.unsqueeze(-1)).exp().view(bs, n_kv_heads, -1, s, sk)
    out = probs @ v.float().unsqueeze(2)  # (bs, hkv, n_rep, s, d)
    return out.flatten(1, 2), lse
