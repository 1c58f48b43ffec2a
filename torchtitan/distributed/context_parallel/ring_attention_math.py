"""Ring attention's math, single process: which part of a K/V block the local queries see (block
plans), one block's attention and its flash-style backward, the online-softmax merge, and the
attention sinks folded in after it (with their gradient).

No communication here (that is ``ring_comms``); ``context_parallel`` runs these per block while
K/V travel between ranks. Scores are fp32 (bs, h, sq, sk); a mask is either (sq, sk) (causal, the
same for every batch row) or (bs, 1, sq, sk) (block-causal, per row); both broadcast against them.
q and k heads are dk wide, v heads (and the output) dv wide; dk != dv is fine (DeepSeek's MLA).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from torchtitan.models.common.documents import block_causal_mask


@dataclass(frozen=True)
class _BlockPlan:
    """The part of a (q block, k block) pair that the mask leaves visible.

    rows/cols bound the visible region (for the mirrored causal layout it is exactly one half-chunk,
    so off-diagonal blocks cost half); mask is None where everything inside is visible.
    """

    rows: slice
    cols: slice
    mask: torch.Tensor | None  # (n_rows, n_cols) causal or (bs, 1, n_rows, n_cols) block-causal; True = visible


def _plan_block(
    q_pos: list[int] | torch.Tensor, k_pos: list[int] | torch.Tensor, window: int | None = None
) -> _BlockPlan | None:
    """Causal (and within ``window`` when given): None when no query sees any key (the block is skipped).

    Positions ascending (ints or a CPU tensor). Query q sees key k iff k <= q and q - k < window
    (window: the tokens a query sees, itself included; None: unbounded). The visible region's bounds
    come from the positions alone (host arithmetic, no tensor values read), so planning also works
    on fake tensors; only a partly visible block builds a mask.
    """
    q_pos, k_pos = _as_list(q_pos), _as_list(k_pos)
    # Row i sees the keys k_pos[lo:hi]: lo the first key inside the window, hi the first in the future.
    spans = [(_window_start(k_pos, q, window), bisect.bisect_right(k_pos, q)) for q in q_pos]
    seen = [i for i, (lo, hi) in enumerate(spans) if hi > lo]
    if not seen:
        return None
    rows = slice(seen[0], seen[-1] + 1)
    cols = slice(min(spans[i][0] for i in seen), max(spans[i][1] for i in seen))
    if all(lo <= cols.start and hi >= cols.stop for lo, hi in spans[rows]):
        return _BlockPlan(rows, cols, None)
    q, k = torch.tensor(q_pos[rows])[:, None], torch.tensor(k_pos[cols])[None, :]
    visible = k <= q if window is None else (k <= q) & (q - k < window)  # (n_rows, n_cols)
    return _BlockPlan(rows, cols, visible)


def _window_start(k_pos: list[int], q: int, window: int | None) -> int:
    """Index of the first key a query at position q sees: the first with q - k < window (0 without one)."""
    return 0 if window is None else bisect.bisect_right(k_pos, q - window)


def _as_list(positions: list[int] | torch.Tensor) -> list[int]:
    return positions.tolist() if isinstance(positions, torch.Tensor) else list(positions)


def plan_document_blocks(
    q_doc: torch.Tensor, k_docs: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None
) -> list[_BlockPlan | None]:
    """Block-causal plans (within ``window`` when given) of one rank's queries against every block, over the batch.

    q_doc (bs, sq) the queries' document ids; k_docs (n_blocks, bs, sk) each block's; q_pos (sq,),
    k_pos (n_blocks, sk) global positions; all on one device. A block is None when no (batch row,
    query, key) is visible; otherwise its rows/cols bound the union over batch rows.
    """
    n_blocks, sq = k_docs.shape[0], q_doc.shape[1]
    visible = torch.stack(
        [block_causal_mask(q_doc, k_docs[j], q_pos, k_pos[j]) for j in range(n_blocks)]
    )  # (n_blocks, bs, 1, sq, sk), computed where the ids live
    if window is not None:
        near = q_pos[None, :, None] - k_pos[:, None, :] < window  # (n_blocks, sq, sk)
        visible = visible & near[:, None, None]
    rows = visible.any(dim=(1, 2, 4))  # (n_blocks, sq)
    cols = visible.any(dim=(1, 2, 3))  # (n_blocks, sk)
    counts = visible.sum(dim=(1, 2, 3, 4))  # (n_blocks,) visible pairs
    # The one device -> host sync of a micro-batch's planning: slices need host ints, so only these
    # small vectors cross, never the masks.
    summary = torch.cat([rows.long(), cols.long(), counts[:, None]], dim=1).tolist()  # (n_blocks, sq + sk + 1)
    return [_document_plan(visible[j], summary[j][:sq], summary[j][sq:-1], summary[j][-1]) for j in range(n_blocks)]


def _document_plan(visible: torch.Tensor, rows: list[int], cols: list[int], count: int) -> _BlockPlan | None:
    """visible (bs, 1, sq, sk); rows/cols: 1 where some batch row's query/key takes part; count: visible pairs."""
    if count == 0:
        return None
    r0, r1 = rows.index(1), len(rows) - rows[::-1].index(1)
    c0, c1 = cols.index(1), len(cols) - cols[::-1].index(1)
    box = visible.shape[0] * (r1 - r0) * (c1 - c0)
    mask = None if count == box else visible[:, :, r0:r1, c0:c1]  # (bs, 1, n_rows, n_cols)
    return _BlockPlan(slice(r0, r1), slice(c0, c1), mask)


def _expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(bs, n_kv_heads, s, d) -> (bs, n_heads, s, d), as CausalAttention's repeat_interleave."""
    return x.repeat_interleave(n_heads // x.shape[1], dim=1)


def _reduce_kv(grad: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """(bs, n_heads, s, d) -> (bs, n_kv_heads, s, d): sum each kv head's query group."""
    return grad.unflatten(1, (n_kv_heads, -1)).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """fp32 (bs, h, sq, sk) scaled scores, -inf where masked. k already expanded to q's heads.

    mask (sq, sk) or (bs, 1, sq, sk), True = visible: either broadcasts over the scores.
    """
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale  # (bs, h, sq, sk)
    return s if mask is None else s.masked_fill(~mask.to(s.device), float("-inf"))


def _attend(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 block output (bs, h, sq, dv) and lse (bs, h, sq); a row that sees no key: 0 and -inf."""
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
        return  # no local query sees any key of this block
    block_out, block_lse = _attend(q[:, :, plan.rows], k[:, :, plan.cols], v[:, :, plan.cols], plan.mask, scale)
    merge_attention_(out[:, :, plan.rows], lse[:, :, plan.rows], block_out, block_lse)


def _new_accumulators(q: torch.Tensor, v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty fp32 (out (bs, h, sq, v_head_dim), lse (bs, h, sq)): out = 0 and lse = -inf everywhere."""
    bs, n_heads, seqlen, _ = q.shape
    # (bs, h, sq, dv) viewed over (bs, sq, h, dv) memory, like the SDPA kernels' output: the model's
    # out.transpose(1, 2).reshape(bs, seqlen, -1) is then a view, not a second saved copy.
    out = torch.zeros(bs, seqlen, n_heads, v_head_dim, dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)  # (bs, h, sq)
    return out, lse


def compute_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's fp32 (out (bs, h, sq, dv), lse (bs, h, sq)) under the causal (windowed) mask of global positions.

    Rows that see no key get out = 0 and lse = -inf, which merge_attention_ treats as empty.
    """
    out, lse = _new_accumulators(q, v.shape[-1])
    _accumulate_block(out, lse, q, k, v, _plan_block(q_pos.cpu(), k_pos.cpu(), window), scale)
    return out, lse


def apply_sinks_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Fold each head's sink logit into the merged (out, lse), in place, once after the last block.

    out (bs, h, sq, dv), lse (bs, h, sq) fp32; sinks (h,). The sink is one more key with value 0:
    out' = out * sigmoid(lse - sink), lse' = logaddexp(lse, sink) (gpt_oss ``apply_sinks``). With
    (out', lse') the usual flash backward gives the exact dq, dk, dv; ``compute_sink_grad`` the sinks'.
    """
    sink = sinks.float().view(1, -1, 1)  # (1, h, 1)
    out.mul_(torch.sigmoid(lse - sink).unsqueeze(-1))
    lse.copy_(torch.logaddexp(lse, sink))


def compute_sink_grad(lse: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks (h,) fp32 from the sink-corrected lse' and delta = rowsum(dO * out'), both (bs, h, sq).

    The sink's probability is exp(sink - lse') = sigmoid(sink - lse); its score's gradient is
    p_sink * (dO . 0 - delta), summed over the batch and this rank's queries.
    """
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)  # (bs, h, sq)
    return -(p_sink * delta).sum(dim=(0, 2))


def _block_backward(q, k, v, dout, lse, delta, mask, scale):
    """Flash-attention backward of one block from the final lse: fp32 (dq, dk, dv), dk/dv compact, dv v's width.

    The final lse is finite (every token sees itself), so a masked score gives p = exp(-inf) = 0,
    also in a row that sees nothing of this block.
    """
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    k_full, v_full = _expand_kv(k, n_heads).float(), _expand_kv(v, n_heads).float()  # (bs, h, sk, d)
    p = torch.exp(_scores(q, k_full, mask, scale) - lse.unsqueeze(-1))  # (bs, h, sq, sk) final probs
    dv = torch.matmul(p.transpose(-2, -1), dout)  # (bs, h, sk, dv)
    dp = torch.matmul(dout, v_full.transpose(-2, -1))  # (bs, h, sq, sk)
    ds = p * (dp - delta.unsqueeze(-1))  # softmax backward; delta = rowsum(dO * O)
    dq = torch.matmul(ds, k_full) * scale  # (bs, h, sq, d)
    dk = torch.matmul(ds.transpose(-2, -1), q.float()) * scale  # (bs, h, sk, d)
    return dq, _reduce_kv(dk, n_kv_heads), _reduce_kv(dv, n_kv_heads)


def _accumulate_block_grad(dq, dkv, q, k, v, dout, lse, delta, plan: _BlockPlan | None, scale) -> None:
    """Add one K/V block's contribution to dq (bs, h, sq, dk) and dkv (bs, hkv, sk, dk + dv) = [dK | dV], fp32."""
    if plan is None:
        return
    r, c, head_dim = plan.rows, plan.cols, k.shape[-1]
    block_dq, block_dk, block_dv = _block_backward(
        q[:, :, r], k[:, :, c], v[:, :, c], dout[:, :, r], lse[:, :, r], delta[:, :, r], plan.mask, scale
    )
    dq[:, :, r] += block_dq
    dkv[:, :, c, :head_dim] += block_dk
    dkv[:, :, c, head_dim:] += block_dv
