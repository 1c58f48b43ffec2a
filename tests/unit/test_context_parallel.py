"""Context parallel, single process: the sequence layout and the block / online-softmax math."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torchtitan.distributed.context_parallel.context_parallel import (
    RingAttention,
    compute_block_attention,
    compute_cp_positions,
    is_sink_kernel,
    merge_attention_,
    shard_sequence,
)
from torchtitan.distributed.context_parallel.ring_attention_math import _plan_block, plan_document_blocks
from torchtitan.models.gpt_oss.model import SinkAttention
from torchtitan.models.llama.model import CausalAttention

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: only the order of the softmax reductions differs


def test_load_balanced_layout_is_head_plus_mirrored_tail() -> None:
    assert compute_cp_positions(8, 2, 0, load_balance=True).tolist() == [0, 1, 6, 7]
    assert compute_cp_positions(8, 2, 1, load_balance=True).tolist() == [2, 3, 4, 5]
    assert compute_cp_positions(8, 2, 1, load_balance=False).tolist() == [4, 5, 6, 7]
    assert compute_cp_positions(8, 2, 0, load_balance=True).dtype == torch.int64


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("load_balance", [True, False])
def test_positions_over_ranks_are_a_permutation(cp: int, load_balance: bool) -> None:
    union = torch.cat([compute_cp_positions(32, cp, r, load_balance) for r in range(cp)])
    assert union.shape == (32,)
    assert sorted(union.tolist()) == list(range(32))


def test_load_balanced_causal_work_is_even() -> None:
    work = [sum(int(p) + 1 for p in compute_cp_positions(64, 4, r, True)) for r in range(4)]
    assert len(set(work)) == 1  # visible keys per rank, summed over its queries


@pytest.mark.parametrize(
    ("seq_len", "cp", "load_balance", "need"),
    [
        (12, 4, True, "2 × context_parallel_degree = 8"),
        (10, 4, False, "context_parallel_degree = 4"),
    ],
)
def test_indivisible_seq_len_is_rejected(seq_len: int, cp: int, load_balance: bool, need: str) -> None:
    with pytest.raises(ValueError, match="training.seq_len") as info:
        compute_cp_positions(seq_len, cp, 0, load_balance)
    assert need in str(info.value) and str(seq_len) in str(info.value)


def test_shard_sequence_selects_positions_along_dim() -> None:
    x, y = torch.arange(16).view(2, 8), torch.arange(8)
    positions = compute_cp_positions(8, 2, 0, load_balance=True)
    (xs,), (ys,) = shard_sequence([x], 1, positions), shard_sequence([y], 0, positions)
    assert xs.tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]] and xs.is_contiguous()
    assert ys.tolist() == [0, 1, 6, 7]


@pytest.mark.parametrize("n_kv_heads", [2, 4])
@pytest.mark.parametrize("load_balance", [True, False])
def test_blocks_merged_with_online_softmax_equal_causal_attention(n_kv_heads: int, load_balance: bool) -> None:
    torch.manual_seed(0)
    bs, n_heads, seq, head_dim, cp = 2, 4, 16, 8, 4
    q = torch.randn(bs, n_heads, seq, head_dim)
    k, v = torch.randn(bs, n_kv_heads, seq, head_dim), torch.randn(bs, n_kv_heads, seq, head_dim)
    expected = CausalAttention()(q, k, v)  # (bs, n_heads, seq, head_dim)
    positions = [compute_cp_positions(seq, cp, r, load_balance) for r in range(cp)]
    for q_pos in positions:  # each rank's queries against every rank's block, in ring order
        out, lse = compute_block_attention(q[:, :, q_pos], k[:, :, q_pos], v[:, :, q_pos], q_pos, q_pos, head_dim**-0.5)
        for k_pos in positions:
            if k_pos is not q_pos:
                merge_attention_(
                    out,
                    lse,
                    *compute_block_attention(
                        q[:, :, q_pos], k[:, :, k_pos], v[:, :, k_pos], q_pos, k_pos, head_dim**-0.5
                    ),
                )
        torch.testing.assert_close(out, expected[:, :, q_pos], **TOL)


def test_fully_masked_rows_merge_without_nan() -> None:
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    future = compute_block_attention(q, k, k, torch.arange(4), torch.arange(4, 8), 1.0)  # sees nothing
    assert torch.equal(future[0], torch.zeros_like(future[0])) and bool((future[1] == float("-inf")).all())
    out, lse = compute_block_attention(q, k, k, torch.arange(4), torch.arange(2, 6), 1.0)  # rows 0, 1 empty
    merge_attention_(out, lse, *future)
    assert not out.isnan().any() and bool((lse[..., :2] == float("-inf")).all())
    merge_attention_(out, lse, *compute_block_attention(q, k, k, torch.arange(4), torch.arange(4), 1.0))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_unknown_rotate_method_is_rejected() -> None:
    with pytest.raises(ValueError, match="rotate_method = 'ring'.*allgather, alltoall"):
        RingAttention(None, rotate_method="ring", load_balance=True)


def test_document_plans_skip_empty_blocks_and_bound_the_union_over_rows() -> None:
    # cp 2, load balanced, seq 8: this rank (0) holds positions 0, 1, 6, 7; rank 1 holds 2, 3, 4, 5.
    q_pos, k_pos = torch.tensor([0, 1, 6, 7]), torch.tensor([[0, 1, 6, 7], [2, 3, 4, 5]])
    all_docs = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0, 1]])  # (bs, seq) by position
    k_docs = torch.stack([all_docs[:, k] for k in k_pos])  # (cp, bs, 4)
    own, other = plan_document_blocks(k_docs[0], k_docs, q_pos, k_pos)
    assert own.rows == slice(0, 4) and own.cols == slice(0, 4) and own.mask.shape == (2, 1, 4, 4)
    # block 1: only row 1's query at position 6 sees keys 2..5 (its document 0); union box = that row
    assert other.rows == slice(2, 3) and other.cols == slice(0, 4) and other.mask.shape == (2, 1, 1, 4)
    assert other.mask[:, 0, 0].tolist() == [[False] * 4, [True] * 4]
    all_docs[1, 6] = 1  # now no query of this rank sees block 1 in any row
    k_docs = torch.stack([all_docs[:, k] for k in k_pos])
    assert plan_document_blocks(k_docs[0], k_docs, q_pos, k_pos)[1] is None


def test_document_plan_of_a_fully_visible_box_has_no_mask() -> None:
    q_pos, k_pos = torch.tensor([2, 3]), torch.tensor([[2, 3], [0, 1]])
    docs = torch.zeros(3, 2, 2, dtype=torch.int64)  # (cp blocks, bs, s): one document everywhere
    plan = plan_document_blocks(docs[0], docs[:2], q_pos, k_pos)[1]
    assert plan.rows == slice(0, 2) and plan.cols == slice(0, 2) and plan.mask is None


def test_block_causal_ring_attention_refuses_fake_document_ids() -> None:
    ring = RingAttention(None, rotate_method="alltoall", load_balance=True)
    with FakeTensorMode():
        q, doc_ids = torch.randn(1, 2, 4, 8), torch.zeros(1, 4, dtype=torch.int64)
        with pytest.raises(NotImplementedError, match="memory estimator cannot model context parallel"):
            ring(q, q, q, doc_ids=doc_ids)


def _brute_visible(q_pos: list[int], k_pos: list[int], window: int | None) -> torch.Tensor:
    q, k = torch.tensor(q_pos)[:, None], torch.tensor(k_pos)[None, :]
    return (k <= q) if window is None else (k <= q) & (q - k < window)  # (sq, sk)


def _check_plan(plan, visible: torch.Tensor) -> None:
    """The plan's box holds every visible pair and its mask (or all of it) is exactly the visible part.

    visible: (sq, sk), or (bs, sq, sk) for a document plan (whose box bounds the union over rows).
    """
    if plan is None:
        assert not visible.any()
        return
    inside = torch.zeros_like(visible)
    inside[..., plan.rows, plan.cols] = True
    box = visible[..., plan.rows, plan.cols]
    assert not (visible & ~inside).any() and box.any()
    assert bool(box.all()) if plan.mask is None else torch.equal(plan.mask.reshape(box.shape), box)


@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("window", [1, 3, 4, 9, 20, None])
def test_windowed_causal_plans_cover_exactly_the_visible_pairs_and_skip_blocks_beyond_the_window(
    load_balance: bool, window: int | None
) -> None:
    cp, seq = 4, 32  # chunks of 4 tokens (load-balanced) or 8
    positions = [compute_cp_positions(seq, cp, r, load_balance).tolist() for r in range(cp)]
    skipped = {window: 0, None: 0}
    for mine in positions:
        for theirs in positions:
            for w in skipped:
                plan = _plan_block(mine, theirs, w)
                _check_plan(plan, _brute_visible(mine, theirs, w))
                skipped[w] += plan is None
    # causal alone skips the blocks wholly in the future; a window within one chunk also the far past
    assert skipped[None] == (0 if load_balance else cp * (cp - 1) // 2)
    if window is not None and window <= seq // (2 * cp):
        assert skipped[window] > skipped[None]


@pytest.mark.parametrize("window", [2, 5, None])
def test_document_plans_intersect_the_window(window: int | None) -> None:
    cp, seq = 2, 16
    positions = torch.stack([compute_cp_positions(seq, cp, r, True) for r in range(cp)])  # (cp, 8)
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])  # (bs, seq)
    k_docs = torch.stack([docs[:, p] for p in positions])  # (cp, bs, 8)
    for rank in range(cp):
        plans = plan_document_blocks(k_docs[rank], k_docs, positions[rank], positions, window)
        for j, plan in enumerate(plans):
            same = k_docs[rank][:, :, None] == k_docs[j][:, None, :]  # (bs, sq, sk)
            _check_plan(plan, same & _brute_visible(positions[rank].tolist(), positions[j].tolist(), window))


def test_a_kernel_with_a_window_but_no_sinks_argument_is_refused() -> None:
    class WindowOnly(torch.nn.Module):
        window = 4

        def forward(self, q, k, v, doc_ids=None):
            return q

    with pytest.raises(NotImplementedError, match="no ring kernel for WindowOnly"):
        is_sink_kernel(WindowOnly())
    assert not is_sink_kernel(CausalAttention())
    assert is_sink_kernel(SinkAttention(4)) and is_sink_kernel(SinkAttention(None))
