"""Context parallel: shard the sequence over a CP group and run ring attention across it.

Our own ring attention, portable to any device and backend: torch's ``context_parallel`` only has
ring handlers for the CUDA SDPA kernels and fails on CPU (see notes/torch-2.13-cpu.md, section 5).

Layout (cp = the CP degree). Every rank holds seq_len / cp tokens of every sequence, and all
token-wise layers (embedding, norms, projections, feed-forward, loss) run on them unchanged. Only
attention mixes tokens: each rank's queries must see the keys and values of every earlier token,
wherever they live. With load balancing the sequence is cut into 2 * cp chunks and rank r holds
chunk r and its mirror 2*cp-1-r, so every rank gets the same amount of causal work.

Attention works block by block: a block is one rank's K/V chunk. Each block yields a partial
output and its log-sum-exp (lse), and blocks merge with the online-softmax rule, so no rank ever
holds the (seqlen x seqlen) scores. The causal mask comes from global positions, not from local
indices. Two ways to get the blocks:

* ``allgather``: all-gather K and V once; backward reduce-scatters dK/dV back to their owners.
* ``alltoall`` (the ring): pass K/V to the next rank cp-1 times, posting the next hop before
  computing the current block so communication overlaps compute. Backward rotates K/V again and
  sends the dK/dV accumulators around with them; after a full cycle each lands on its owner.

Backward is an explicit flash-attention style pass over the saved output and lse (autograd never
runs through a collective), so a rank saves only its local q, k, v, out and lse.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

ROTATE_METHODS = ("allgather", "alltoall")
_KV_TAG, _GRAD_TAG = 0, 1  # distinct p2p tags: K/V hops and dK/dV hops are in flight together


def cp_position_list(seq_len: int, cp_degree: int, cp_rank: int, load_balance: bool) -> list[int]:
    """Global positions of the tokens that rank ``cp_rank`` holds, ascending (seq_len // cp_degree of them).

    Raises:
        ValueError: seq_len does not split into the chunks the layout needs.
    """
    num_chunks = 2 * cp_degree if load_balance else cp_degree
    if seq_len % num_chunks != 0:
        need = "2 × context_parallel_degree" if load_balance else "context_parallel_degree"
        raise ValueError(
            f"training.seq_len = {seq_len} must be divisible by {need} = {num_chunks} "
            f"(context_parallel_degree = {cp_degree}, load_balance = {load_balance}); "
            f"set training.seq_len to a multiple of {num_chunks}"
        )
    chunk = seq_len // num_chunks
    head = list(range(cp_rank * chunk, (cp_rank + 1) * chunk))
    if not load_balance:
        return head
    mirror = num_chunks - 1 - cp_rank  # the tail chunk balances the head's causal work
    return head + list(range(mirror * chunk, (mirror + 1) * chunk))


def compute_cp_positions(seq_len: int, cp_degree: int, cp_rank: int, load_balance: bool) -> torch.Tensor:
    """``cp_position_list`` as an int64 tensor (seq_len // cp_degree,)."""
    return torch.tensor(cp_position_list(seq_len, cp_degree, cp_rank, load_balance), dtype=torch.int64)


def shard_sequence(tensors: list[torch.Tensor], seq_dim: int, positions: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor's entries at ``positions`` along ``seq_dim`` (contiguous copies)."""
    return [t.index_select(seq_dim, positions.to(t.device)).contiguous() for t in tensors]


# ---------------------------------------------------------------------------------------------
# Block math (single process): one K/V block against the local queries, and the online merge.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _BlockPlan:
    """The part of a (q block, k block) pair that causality leaves visible.

    rows/cols bound the visible region (for the mirrored layout it is exactly one half-chunk, so
    off-diagonal blocks cost half); mask is None where everything inside is visible.
    """

    rows: slice
    cols: slice
    mask: torch.Tensor | None  # (n_rows, n_cols) bool, True = visible


def _plan_block(q_pos: list[int] | torch.Tensor, k_pos: list[int] | torch.Tensor) -> _BlockPlan | None:
    """None when no query sees any key (the block is skipped). Positions ascending (ints or a CPU tensor).

    The visible region's bounds come from the positions alone (host arithmetic, no tensor values
    read), so planning also works on fake tensors; only a partly visible block builds a mask.
    """
    q_pos, k_pos = _as_list(q_pos), _as_list(k_pos)
    first_row = bisect.bisect_left(q_pos, k_pos[0])  # rows whose query sees the first key
    if first_row == len(q_pos):
        return None
    rows = slice(first_row, len(q_pos))
    cols = slice(0, bisect.bisect_right(k_pos, q_pos[-1]))  # keys seen by the last query
    if q_pos[first_row] >= k_pos[cols.stop - 1]:
        return _BlockPlan(rows, cols, None)
    visible = torch.tensor(q_pos)[:, None] >= torch.tensor(k_pos)[None, :]  # (sq, sk)
    return _BlockPlan(rows, cols, visible[rows, cols])


def _as_list(positions: list[int] | torch.Tensor) -> list[int]:
    return positions.tolist() if isinstance(positions, torch.Tensor) else list(positions)


def _expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(bs, n_kv_heads, s, d) -> (bs, n_heads, s, d), as CausalAttention's repeat_interleave."""
    return x.repeat_interleave(n_heads // x.shape[1], dim=1)


def _reduce_kv(grad: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """(bs, n_heads, s, d) -> (bs, n_kv_heads, s, d): sum each kv head's query group."""
    return grad.unflatten(1, (n_kv_heads, -1)).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """fp32 (bs, h, sq, sk) scaled scores, -inf where masked. k already expanded to q's heads."""
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale  # (bs, h, sq, sk)
    return s if mask is None else s.masked_fill(~mask.to(s.device), float("-inf"))


def _attend(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 block output (bs, h, sq, d) and lse (bs, h, sq); a row that sees no key: 0 and -inf."""
    n_heads = q.shape[1]
    s = _scores(q, _expand_kv(k, n_heads), mask, scale)  # (bs, h, sq, sk)
    lse = torch.logsumexp(s, dim=-1)  # (bs, h, sq)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)  # a fully masked row: exp(-inf - 0) = 0, not NaN
    p = torch.exp(s - safe.unsqueeze(-1))  # (bs, h, sq, sk)
    return torch.matmul(p, _expand_kv(v, n_heads).float()), lse


def merge_attention_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online softmax: fold a block's (out, lse) into the running (out, lse), in place.

    out/block_out (bs, h, sq, d) fp32; lse/block_lse (bs, h, sq) fp32. A row with lse = -inf on
    both sides (no visible key yet) stays out = 0, lse = -inf instead of becoming NaN.
    """
    new_lse = torch.logaddexp(lse, block_lse)  # (bs, h, sq)
    safe = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # exp(-inf - 0) = 0, never -inf + inf
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(new_lse)


def _accumulate_block(out, lse, q, k, v, plan: _BlockPlan | None, scale) -> None:
    """Attend the local queries to one K/V block and merge it into the running (out, lse)."""
    if plan is None:
        return  # entirely in the future of every local query
    block_out, block_lse = _attend(q[:, :, plan.rows], k[:, :, plan.cols], v[:, :, plan.cols], plan.mask, scale)
    merge_attention_(out[:, :, plan.rows], lse[:, :, plan.rows], block_out, block_lse)


def _new_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bs, n_heads, seqlen, head_dim = q.shape
    # (bs, h, sq, d) viewed over (bs, sq, h, d) memory, like the SDPA kernels' output: the model's
    # out.transpose(1, 2).reshape(bs, seqlen, -1) is then a view, not a second saved copy.
    out = torch.zeros(bs, seqlen, n_heads, head_dim, dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)  # (bs, h, sq)
    return out, lse


def compute_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's fp32 (out (bs, h, sq, d), lse (bs, h, sq)) under the causal mask of global positions.

    Rows that see no key get out = 0 and lse = -inf, which merge_attention_ treats as empty.
    """
    out, lse = _new_accumulators(q)
    _accumulate_block(out, lse, q, k, v, _plan_block(q_pos.cpu(), k_pos.cpu()), scale)
    return out, lse


def _block_backward(q, k, v, dout, lse, delta, mask, scale):
    """Flash-attention backward of one block from the final lse: fp32 (dq, dk, dv), dk/dv compact."""
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    k_full, v_full = _expand_kv(k, n_heads).float(), _expand_kv(v, n_heads).float()  # (bs, h, sk, d)
    p = torch.exp(_scores(q, k_full, mask, scale) - lse.unsqueeze(-1))  # (bs, h, sq, sk) final probs
    dv = torch.matmul(p.transpose(-2, -1), dout)  # (bs, h, sk, d)
    dp = torch.matmul(dout, v_full.transpose(-2, -1))  # (bs, h, sq, sk)
    ds = p * (dp - delta.unsqueeze(-1))  # softmax backward; delta = rowsum(dO * O)
    dq = torch.matmul(ds, k_full) * scale  # (bs, h, sq, d)
    dk = torch.matmul(ds.transpose(-2, -1), q.float()) * scale  # (bs, h, sk, d)
    return dq, _reduce_kv(dk, n_kv_heads), _reduce_kv(dv, n_kv_heads)


def _accumulate_block_grad(dq, dkv, q, k, v, dout, lse, delta, plan: _BlockPlan | None, scale) -> None:
    """Add one K/V block's contribution to dq (bs, h, sq, d) and dkv (2, bs, hkv, sk, d), fp32."""
    if plan is None:
        return
    r, c = plan.rows, plan.cols
    block_dq, block_dk, block_dv = _block_backward(
        q[:, :, r], k[:, :, c], v[:, :, c], dout[:, :, r], lse[:, :, r], delta[:, :, r], plan.mask, scale
    )
    dq[:, :, r] += block_dq
    dkv[0][:, :, c] += block_dk
    dkv[1][:, :, c] += block_dv


# ---------------------------------------------------------------------------------------------
# Communication: the two ways a rank gets the other ranks' K/V blocks.
# ---------------------------------------------------------------------------------------------


def _ring_shift(tensor: torch.Tensor, group: dist.ProcessGroup, tag: int) -> tuple[torch.Tensor, list]:
    """Post: send ``tensor`` to the next rank, receive the previous rank's into a new buffer."""
    rank, size = group.rank(), group.size()
    recv = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % size), group, tag),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % size), group, tag),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(...) -> (cp, ...): every rank's tensor, in group-rank order."""
    out = torch.empty((group.size() * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_single(out, tensor.contiguous(), group=group)
    return out.unflatten(0, (group.size(), tensor.shape[0]))


def _forward_allgather(q, k, v, group, plans, scale):
    rank = group.rank()
    kv = _all_gather(torch.stack([k, v]), group)  # (cp, 2, bs, hkv, s, d), compact heads
    out, lse = _new_accumulators(q)
    for step in range(group.size()):
        j = (rank - step) % group.size()  # own block first: every row then has a finite lse
        _accumulate_block(out, lse, q, kv[j, 0], kv[j, 1], plans[rank][j], scale)
    return out, lse


def _forward_ring(q, k, v, group, plans, scale):
    rank, size = group.rank(), group.size()
    kv = torch.stack([k, v])  # (2, bs, hkv, s, d): one message per hop
    out, lse = _new_accumulators(q)
    for step in range(size):
        if step < size - 1:
            next_kv, works = _ring_shift(kv, group, _KV_TAG)  # in flight while this block computes
        j = (rank - step) % size  # the block this rank holds at this step
        _accumulate_block(out, lse, q, kv[0], kv[1], plans[rank][j], scale)
        if step < size - 1:
            _wait(works)
            kv = next_kv
    return out, lse


def _backward_allgather(q, k, v, dout, lse, delta, group, plans, scale):
    rank, size = group.rank(), group.size()
    kv = _all_gather(torch.stack([k, v]), group)  # gathered again: saving it would cost cp x memory
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # (cp, 2, bs, hkv, s, d)
    for j in range(size):
        _accumulate_block_grad(dq, dkv[j], q, kv[j, 0], kv[j, 1], dout, lse, delta, plans[rank][j], scale)
    own = torch.empty(dkv.shape[1:], dtype=torch.float32, device=q.device)  # (2, bs, hkv, s, d)
    dist.reduce_scatter_single(own, dkv.flatten(0, 1), op=dist.ReduceOp.SUM, group=group)
    return dq, own


def _backward_ring(q, k, v, dout, lse, delta, group, plans, scale):
    rank, size = group.rank(), group.size()
    kv = torch.stack([k, v])  # (2, bs, hkv, s, d)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    # pending: (the dK/dV accumulator in flight to this rank, its works). An accumulator travels
    # with its K/V block, one hop behind, summing the grads of every rank the block visits.
    pending = None
    for step in range(size):
        if step < size - 1:
            next_kv, kv_works = _ring_shift(kv, group, _KV_TAG)
        j = (rank - step) % size
        block_grad = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        _accumulate_block_grad(dq, block_grad, q, kv[0], kv[1], dout, lse, delta, plans[rank][j], scale)
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
    """Explicit forward/backward so autograd never differentiates through a collective."""

    @staticmethod
    def forward(ctx, q, k, v, group, rotate_method, plans):
        scale = q.shape[-1] ** -0.5
        out, lse = _FORWARD[rotate_method](q, k, v, group, plans, scale)
        out = out.to(q.dtype)  # (bs, h, sq, d)
        ctx.save_for_backward(q, k, v, out, lse)  # local only: O(seqlen / cp) per rank
        ctx.group, ctx.rotate_method, ctx.plans, ctx.scale = group, rotate_method, plans, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.float()  # (bs, h, sq, d)
        delta = (dout * out.float()).sum(-1)  # (bs, h, sq) = rowsum(dO * O)
        dq, dkv = _BACKWARD[ctx.rotate_method](q, k, v, dout, lse, delta, ctx.group, ctx.plans, ctx.scale)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


class RingAttention(nn.Module):
    """Drop-in for CausalAttention on a rank's sequence shard: full causal attention, this rank's rows.

    q (bs, n_heads, local_seqlen, head_dim), k/v (bs, n_kv_heads, local_seqlen, head_dim) hold the
    tokens at ``compute_cp_positions(local_seqlen * cp, cp, rank, load_balance)``. K/V travel with
    their compact kv heads; grouped-query heads are expanded after communication.
    """

    def __init__(
        self, cp_group: dist.ProcessGroup, *, rotate_method: Literal["allgather", "alltoall"], load_balance: bool
    ):
        super().__init__()
        if rotate_method not in ROTATE_METHODS:
            raise ValueError(
                f"experimental.context_parallel_rotate_method = {rotate_method!r}: "
                f"allowed are {', '.join(ROTATE_METHODS)}"
            )
        self.cp_group, self.rotate_method, self.load_balance = cp_group, rotate_method, load_balance
        # local seqlen -> plans[i][j]: what rank i's queries see of rank j's block (from CPU positions,
        # once per shape: no per-step nonzero or host sync)
        self._plans: dict[int, list[list[_BlockPlan | None]]] = {}

    def extra_repr(self) -> str:
        return f"cp={self.cp_group.size()}, rotate_method={self.rotate_method}, load_balance={self.load_balance}"

    def block_plans(self, local_seqlen: int) -> list[list[_BlockPlan | None]]:
        """plans[i][j] for every pair of ranks' blocks, from the global positions (host ints, computed once)."""
        if local_seqlen not in self._plans:
            cp = self.cp_group.size()
            seq_len = local_seqlen * cp
            if seq_len % (2 * cp if self.load_balance else cp) != 0:
                raise ValueError(
                    f"ring attention got a local seqlen of {local_seqlen} on context_parallel_degree = {cp} "
                    f"with load_balance = {self.load_balance}: with load balancing each rank holds two equal "
                    "chunks, so the local seqlen must be even; shard inputs with "
                    "compute_cp_positions(training.seq_len, ...) and shard_sequence"
                )
            positions = [cp_position_list(seq_len, cp, r, self.load_balance) for r in range(cp)]
            self._plans[local_seqlen] = [
                [_plan_block(positions[i], positions[j]) for j in range(cp)] for i in range(cp)
            ]
        return self._plans[local_seqlen]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (bs, n_heads, s, d); k, v (bs, n_kv_heads, s, d) -> (bs, n_heads, s, d)."""
        if k.shape[2] != q.shape[2] or v.shape != k.shape or q.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"ring attention needs q, k, v sharded alike along the sequence, with n_heads a "
                f"multiple of n_kv_heads: got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        plans = self.block_plans(q.shape[2])
        return _RingAttentionFunction.apply(q, k, v, self.cp_group, self.rotate_method, plans)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, *, rotate_method: str, load_balance: bool = True) -> None:
    """Swap every block's attention kernel (``layers[*].attention.sdpa``) for RingAttention on cp_mesh.

    The model stays unaware of CP: the trainer shards inputs, labels and positions with
    ``compute_cp_positions`` / ``shard_sequence`` (the same load_balance as here), and the model
    indexes its RoPE table with the positions it is given. Layers absent on a pipeline stage
    (None) are skipped.
    """
    group = cp_mesh.get_group()
    for block in model.layers.values():
        if block is None:
            continue
        block.attention.sdpa = RingAttention(group, rotate_method=rotate_method, load_balance=load_balance)
