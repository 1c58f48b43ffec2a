"""Context parallel: shard the sequence over a CP group and run ring attention across it.

Our own ring attention, portable to any device and backend: torch's ``context_parallel`` only has
ring handlers for the CUDA SDPA kernels and fails on CPU (see notes/torch-2.13-cpu.md, section 5).

Every rank holds seq_len / cp tokens of every sequence (the layout: ``compute_cp_positions``), and
all token-wise layers (embedding, norms, projections, feed-forward, loss) run on them unchanged.
Only attention mixes tokens: each rank's queries must see the keys and values of every earlier
token, wherever they live.

Attention works block by block: a block is one rank's K/V chunk. Each block yields a partial
output and its log-sum-exp (lse), and blocks merge with the online-softmax rule, so no rank ever
holds the (seqlen x seqlen) scores. The mask comes from global positions, not from local indices;
under ``model.attn_mask_type = "block_causal"`` also from the documents (``doc_ids``): a block no
query of the batch sees at all is skipped. Two ways to get the blocks:

* ``allgather``: all-gather K and V once; backward reduce-scatters dK/dV back to their owners.
* ``alltoall`` (the ring): pass K/V to the next rank cp-1 times, posting the next hop before
  computing the current block so communication overlaps compute. Backward rotates K/V again and
  sends the dK/dV accumulators around with them; after a full cycle each lands on its owner.

Backward is an explicit flash-attention style pass over the saved output and lse (autograd never
runs through a collective), so a rank saves only its local q, k, v, out and lse.

Beyond llama's kernel: v heads may be narrower or wider than q/k heads (DeepSeek-V3's MLA; K and V
travel side by side as one [K | V] tensor), and a sink kernel (gpt-oss's sliding window with
attention sinks) becomes ``RingSinkAttention``: window-aware block plans, the sinks folded into the
merged (out, lse) once, an exact backward over the corrected pair (docs/context_parallel.md).

This file holds the schedules and the module; the block math is in ``ring_attention_math``, the
layout and block plans in ``ring_attention_plans``, the collectives in ``ring_comms``.
"""

from __future__ import annotations

import inspect
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.backend.c10d_compat import reduce_scatter_single
from torchtitan.distributed.context_parallel.ring_attention_math import (
    _accumulate_block,
    _accumulate_block_grad,
    _new_accumulators,
    apply_sinks_,
    compute_block_attention,
    compute_sink_grad,
    merge_attention_,
)
from torchtitan.distributed.context_parallel.ring_attention_plans import (
    RingAttentionPlanner,
    compute_cp_positions,
    cp_position_list,
)
from torchtitan.distributed.context_parallel.ring_comms import _all_gather, _ring_shift, _wait

__all__ = [
    "ROTATE_METHODS",
    "RingAttention",
    "RingAttentionPlanner",
    "RingSinkAttention",
    "apply_cp",
    "compute_block_attention",
    "compute_cp_positions",
    "cp_position_list",
    "is_sink_kernel",
    "merge_attention_",
    "shard_sequence",
]

ROTATE_METHODS = ("allgather", "alltoall")
_KV_TAG, _GRAD_TAG = 0, 1  # distinct p2p tags: K/V hops and dK/dV hops are in flight together


def shard_sequence(tensors: list[torch.Tensor], seq_dim: int, positions: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor's entries at ``positions`` along ``seq_dim`` (contiguous copies)."""
    return [t.index_select(seq_dim, positions.to(t.device)).contiguous() for t in tensors]


# ---------------------------------------------------------------------------------------------
# Schedules: the order of hops and blocks. plans[j]: what this rank's queries see of rank j's block.
# K and V travel as one tensor kv = [K | V] (bs, hkv, s, dk + dv), their head dims side by side, so
# v heads may be narrower or wider than k heads; dK/dV travel the same way.
# ---------------------------------------------------------------------------------------------


def _forward_allgather(q, k, v, group, plans, scale):
    rank, dk = group.rank(), k.shape[-1]
    kv = _all_gather(torch.cat([k, v], dim=-1), group)  # (cp, bs, hkv, s, dk + dv), compact heads
    out, lse = _new_accumulators(q, v.shape[-1])
    for step in range(group.size()):
        j = (rank - step) % group.size()  # own block first: every row then has a finite lse
        _accumulate_block(out, lse, q, kv[j, ..., :dk], kv[j, ..., dk:], plans[j], scale)
    return out, lse


def _forward_ring(q, k, v, group, plans, scale):
    rank, size, dk = group.rank(), group.size(), k.shape[-1]
    kv = torch.cat([k, v], dim=-1)  # (bs, hkv, s, dk + dv): one message per hop
    out, lse = _new_accumulators(q, v.shape[-1])
    for step in range(size):
        if step < size - 1:
            next_kv, works = _ring_shift(kv, group, _KV_TAG)  # in flight while this block computes
        j = (rank - step) % size  # the block this rank holds at this step
        _accumulate_block(out, lse, q, kv[..., :dk], kv[..., dk:], plans[j], scale)
        if step < size - 1:
            _wait(works)
            kv = next_kv
    return out, lse


def _backward_allgather(q, k, v, dout, lse, delta, group, plans, scale):
    size, dk = group.size(), k.shape[-1]
    kv = _all_gather(torch.cat([k, v], dim=-1), group)  # gathered again: saving it would cost cp x memory
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # (cp, bs, hkv, s, dk + dv)
    for j in range(size):
        _accumulate_block_grad(dq, dkv[j], q, kv[j, ..., :dk], kv[j, ..., dk:], dout, lse, delta, plans[j], scale)
    own = torch.empty(dkv.shape[1:], dtype=torch.float32, device=q.device)  # (bs, hkv, s, dk + dv)
    reduce_scatter_single(own, dkv.flatten(0, 1), op=dist.ReduceOp.SUM, group=group)
    return dq, own


def _backward_ring(q, k, v, dout, lse, delta, group, plans, scale):
    rank, size, dk = group.rank(), group.size(), k.shape[-1]
    kv = torch.cat([k, v], dim=-1)  # (bs, hkv, s, dk + dv)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    # pending: (the dK/dV accumulator in flight to this rank, its works). An accumulator travels
    # with its K/V block, one hop behind, summing the grads of every rank the block visits.
    pending = None
    for step in range(size):
        if step < size - 1:
            next_kv, kv_works = _ring_shift(kv, group, _KV_TAG)
        j = (rank - step) % size
        block_grad = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        _accumulate_block_grad(dq, block_grad, q, kv[..., :dk], kv[..., dk:], dout, lse, delta, plans[j], scale)
        if pending is not None:  # the previous rank's accumulator for block j; arrived during compute
            _wait(pending[1])
            block_grad += pending[0]
        pending = _ring_shift(block_grad, group, _GRAD_TAG) if size > 1 else (block_grad, [])
        if step < size - 1:
            _wait(kv_works)
            kv = next_kv
    # After `size` hops the accumulator that arrives is this rank's own block's, from every rank.
    _wait(pending[1])
    return dq, pending[0]


_FORWARD = {"allgather": _forward_allgather, "alltoall": _forward_ring}
_BACKWARD = {"allgather": _backward_allgather, "alltoall": _backward_ring}


class _RingAttentionFunction(torch.autograd.Function):
    """Explicit forward/backward so autograd never differentiates through a collective.

    With ``sinks`` (n_heads,) the merged (out, lse) become the sink-corrected (out', lse') before they
    are saved (``apply_sinks_``): the flash backward over them is then exact for q, k and v, and the
    sinks' gradient is one more reduction (``compute_sink_grad``) over this rank's queries.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, rotate_method, plans):
        scale = q.shape[-1] ** -0.5
        out, lse = _FORWARD[rotate_method](q, k, v, group, plans, scale)
        if sinks is not None:
            apply_sinks_(out, lse, sinks)
        out = out.to(q.dtype)  # (bs, h, sq, dv)
        ctx.save_for_backward(q, k, v, out, lse, sinks)  # local only: O(seqlen / cp) per rank
        ctx.group, ctx.rotate_method, ctx.plans, ctx.scale = group, rotate_method, plans, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.float()  # (bs, h, sq, dv)
        delta = (dout * out.float()).sum(-1)  # (bs, h, sq) = rowsum(dO * O)
        dq, dkv = _BACKWARD[ctx.rotate_method](q, k, v, dout, lse, delta, ctx.group, ctx.plans, ctx.scale)
        dk = k.shape[-1]
        # Sinks: replicated over the CP ranks, so this is this rank's queries' share only; FSDP's
        # reduce over dp_shard_cp sums the shares, as it does every parameter's (docs/context_parallel.md).
        dsinks = None if sinks is None else compute_sink_grad(lse, delta, sinks).to(sinks.dtype)
        grads = dq.to(q.dtype), dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype), dsinks
        return *grads, None, None, None


class RingAttention(nn.Module):
    """Drop-in for CausalAttention on a rank's sequence shard: full causal attention, this rank's rows.

    q (bs, n_heads, local_seqlen, dk), k (bs, n_kv_heads, local_seqlen, dk), v (bs, n_kv_heads,
    local_seqlen, dv) hold the tokens at ``compute_cp_positions(local_seqlen * cp, cp, rank,
    load_balance)``; dv may differ from dk (MLA), and the output is dv wide. K/V travel with their
    compact kv heads; grouped-query heads are expanded after communication. With ``doc_ids``
    (bs, local_seqlen), this rank's shard of the document ids at the same positions, attention is
    block-causal. ``planner``: shared by every layer of a model (``apply_cp``); a new one if None.
    """

    def __init__(
        self,
        cp_group: dist.ProcessGroup,
        *,
        rotate_method: Literal["allgather", "alltoall"],
        load_balance: bool,
        planner: RingAttentionPlanner | None = None,
    ):
        super().__init__()
        if rotate_method not in ROTATE_METHODS:
            raise ValueError(
                f"experimental.context_parallel_rotate_method = {rotate_method!r}: "
                f"allowed are {', '.join(ROTATE_METHODS)}"
            )
        if planner is not None and (planner.cp_group is not cp_group or planner.load_balance != load_balance):
            raise ValueError(
                f"RingAttention(load_balance = {load_balance}) got a planner for another CP group or "
                f"load_balance = {planner.load_balance}; pass the planner built for the same group and layout"
            )
        self.cp_group, self.rotate_method, self.load_balance = cp_group, rotate_method, load_balance
        self.planner = planner if planner is not None else RingAttentionPlanner(cp_group, load_balance=load_balance)

    def extra_repr(self) -> str:
        return f"cp={self.cp_group.size()}, rotate_method={self.rotate_method}, load_balance={self.load_balance}"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q (bs, n_heads, s, dk); k (bs, n_kv_heads, s, dk); v (bs, n_kv_heads, s, dv); doc_ids (bs, s) or None.

        Returns (bs, n_heads, s, dv).
        """
        return self._ring(q, k, v, None, doc_ids, window=None)

    def _ring(self, q, k, v, sinks, doc_ids, *, window: int | None) -> torch.Tensor:
        """The ring over checked inputs; sinks (n_heads,) or None; window: tokens a query sees (None: all)."""
        if (
            k.shape[2] != q.shape[2]
            or v.shape[:3] != k.shape[:3]
            or k.shape[3] != q.shape[3]
            or q.shape[1] % k.shape[1]
        ):
            raise ValueError(
                f"ring attention needs q, k, v sharded alike along the sequence, q and k heads equally wide, "
                f"k and v with the same heads, and n_heads a multiple of n_kv_heads: got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if doc_ids is None:
            plans = self.planner.causal_plans(q.shape[2], window)
        elif tuple(doc_ids.shape) != (q.shape[0], q.shape[2]):
            raise ValueError(
                f"ring attention needs doc_ids (bs, local_seqlen) = ({q.shape[0]}, {q.shape[2]}), sharded "
                f"like the inputs; got {tuple(doc_ids.shape)}"
            )
        else:
            plans = self.planner.document_plans(doc_ids, window)
        return _RingAttentionFunction.apply(q, k, v, sinks, self.cp_group, self.rotate_method, plans)


class RingSinkAttention(RingAttention):
    """Drop-in for a sink-attention kernel (gpt-oss's ``SinkAttention``) on a rank's sequence shard.

    The same call, ``(q, k, v, sinks, doc_ids=None)``: causal attention within ``window`` tokens (a
    query at global position p sees keys at p - window < position <= p; None: the whole causal
    context), block-causal with ``doc_ids``, and each head's ``sinks`` (n_heads,) logit joining every
    softmax denominator. Blocks are masked by global positions, blocks wholly outside the window are
    skipped (compute only: K/V still travel the whole ring), and the sinks are applied once, after
    the last block's merge.
    """

    def __init__(
        self,
        cp_group: dist.ProcessGroup,
        *,
        window: int | None,
        rotate_method: Literal["allgather", "alltoall"],
        load_balance: bool,
        planner: RingAttentionPlanner | None = None,
    ):
        super().__init__(cp_group, rotate_method=rotate_method, load_balance=load_balance, planner=planner)
        if window is not None and window < 1:
            raise ValueError(f"ring attention window = {window}: a query sees at least itself; use 1 or more, or None")
        self.window = window

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}"

    def forward(  # type: ignore[override]  # the sink kernel's call, not CausalAttention's
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (bs, n_heads, s, dk); k (bs, n_kv_heads, s, dk); v (bs, n_kv_heads, s, dv); sinks (n_heads,);
        doc_ids (bs, s) or None -> (bs, n_heads, s, dv)."""
        if tuple(sinks.shape) != (q.shape[1],):
            raise ValueError(f"ring attention needs one sink per query head ({q.shape[1]},); got {tuple(sinks.shape)}")
        return self._ring(q, k, v, sinks, doc_ids, window=self.window)


def is_sink_kernel(kernel: nn.Module) -> bool:
    """Whether a block's kernel is a sink-attention kernel: a ``window`` attribute and a ``sinks`` argument.

    Duck-typed so distributed/ names no model family (gpt-oss's ``SinkAttention`` is one).

    Raises:
        NotImplementedError: a kernel with one of the two and not the other, which no ring here reproduces.
    """
    has_window = hasattr(kernel, "window")
    has_sinks = "sinks" in inspect.signature(kernel.forward).parameters
    if has_window != has_sinks:
        raise NotImplementedError(
            f"context parallel has no ring kernel for {type(kernel).__name__} (window attribute: {has_window}, "
            f"sinks argument: {has_sinks}); ring attention runs causal kernels and sink kernels with a window"
        )
    return has_sinks


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, *, rotate_method: str, load_balance: bool = True) -> None:
    """Swap every block's attention kernel (``layers[*].attention.sdpa``) for ring attention on cp_mesh.

    A causal kernel (CausalAttention) becomes RingAttention; a sink kernel (a ``window`` attribute and
    a ``sinks`` argument, gpt-oss's SinkAttention) becomes RingSinkAttention with the same window.
    The model stays unaware of CP: the trainer shards inputs, labels, positions (and doc_ids) with
    ``compute_cp_positions`` / ``shard_sequence`` (the same load_balance as here), and the model
    indexes its RoPE table with the positions it is given. Every block shares one
    RingAttentionPlanner (``block.attention.sdpa.planner``), so a micro-batch's documents are
    gathered once and planned once per window. Layers absent on a pipeline stage (None) are skipped.
    """
    group = cp_mesh.get_group()
    planner = RingAttentionPlanner(group, load_balance=load_balance)
    ring = dict(rotate_method=rotate_method, load_balance=load_balance, planner=planner)
    for block in model.layers.values():
        if block is None:
            continue
        kernel = block.attention.sdpa
        if is_sink_kernel(kernel):
            block.attention.sdpa = RingSinkAttention(group, window=kernel.window, **ring)
        else:
            block.attention.sdpa = RingAttention(group, **ring)
