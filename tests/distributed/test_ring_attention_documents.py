"""Ring attention with documents (``model.attn_mask_type = "block_causal"``) against one process.

One spawn per world size runs every case (spawns dominate the cost). Each case shards q/k/v and the
document ids with the CP layout, runs ring attention under activation checkpointing (so backward
recomputes the forward with the same doc_ids tensor) plus a second "layer" on the same micro-batch,
gathers the output and the q/k/v gradients back into the whole window, and compares them with
``F.scaled_dot_product_attention`` under ``block_causal_mask`` on the whole window. The planner's
skip counters are checked against the blocks the full-window mask leaves empty.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.support.distributed import run_distributed
from torchtitan.distributed.context_parallel.context_parallel import (
    RingAttention,
    RingAttentionPlanner,
    compute_cp_positions,
    shard_sequence,
)
from torchtitan.models.common.documents import block_causal_mask

pytestmark = pytest.mark.distributed

BS, N_HEADS, N_KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 64, 8
ATOL = 1e-5  # fp32: max abs difference; only the order of the softmax reductions differs
WORLD_SIZES = (2, 4)
CASES = [("allgather", True), ("alltoall", True), ("alltoall", False)]


def _documents(world: int) -> torch.Tensor:
    """(BS, SEQ) document ids laid out so that whole blocks are masked.

    Both rows start a document at every edge of the second half's 2*world-layout chunks, so a
    mirrored tail chunk sees only itself. Row 0: one document over chunks 0-1, then one per chunk.
    Row 1: random short documents in the first half (they cross chunk edges or not, by chance).
    """
    chunk = SEQ // (2 * world)
    starts = torch.zeros(BS, SEQ, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, SEQ // 2 :: chunk] = True
    starts[0, 2 * chunk : SEQ // 2 : chunk] = True
    starts[1, : SEQ // 2] |= torch.rand(SEQ // 2, generator=torch.Generator().manual_seed(1)) < 0.3
    return starts.long().cumsum(1) - 1  # (BS, SEQ)


def _expected_skips(docs: torch.Tensor, world: int, rank: int, load_balance: bool) -> int:
    """Blocks j that no (batch row, query of this rank, key of rank j) pair of the full mask sees."""
    visible = block_causal_mask(docs, docs)  # (BS, 1, SEQ, SEQ)
    mine = compute_cp_positions(SEQ, world, rank, load_balance)
    theirs = [compute_cp_positions(SEQ, world, j, load_balance) for j in range(world)]
    return sum(not bool(visible[:, :, mine][:, :, :, keys].any()) for keys in theirs)


def _reference(q, k, v, dout, docs) -> list[torch.Tensor]:
    """Whole-window SDPA under block_causal_mask: [out, dq, dk, dv]."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    groups = N_HEADS // N_KV_HEADS
    out = F.scaled_dot_product_attention(
        q,
        k.repeat_interleave(groups, dim=1),
        v.repeat_interleave(groups, dim=1),
        attn_mask=block_causal_mask(docs, docs),
    )  # (BS, N_HEADS, SEQ, HEAD_DIM)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _gather_window(local: torch.Tensor, world: int, load_balance: bool) -> torch.Tensor:
    """(bs, h, s_local, d) shards of every rank -> (bs, h, SEQ, d) in window order."""
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    full = torch.empty(*local.shape[:2], SEQ, local.shape[3], dtype=local.dtype)
    for j, part in enumerate(parts):
        full[:, :, compute_cp_positions(SEQ, world, j, load_balance)] = part
    return full


def _case(rank: int, world: int, group, rotate_method: str, load_balance: bool) -> dict:
    torch.manual_seed(0)  # the same window on every rank
    q, dout = torch.randn(BS, N_HEADS, SEQ, HEAD_DIM), torch.randn(BS, N_HEADS, SEQ, HEAD_DIM)
    k, v = torch.randn(BS, N_KV_HEADS, SEQ, HEAD_DIM), torch.randn(BS, N_KV_HEADS, SEQ, HEAD_DIM)
    docs = _documents(world)
    positions = compute_cp_positions(SEQ, world, rank, load_balance)
    local = [t.requires_grad_() for t in shard_sequence([q, k, v], 2, positions)]
    (local_docs,) = shard_sequence([docs], 1, positions)  # (BS, s_local)
    planner = RingAttentionPlanner(group, load_balance=load_balance)
    layers = [
        RingAttention(group, rotate_method=rotate_method, load_balance=load_balance, planner=planner) for _ in range(2)
    ]
    # Layer 0 under activation checkpointing: backward recomputes it with the same doc_ids tensor.
    out = checkpoint(layers[0], *local, doc_ids=local_docs, use_reentrant=False)
    second = layers[1](*[t.detach() for t in local], doc_ids=local_docs)  # another layer, same micro-batch
    out.backward(shard_sequence([dout], 2, positions)[0])
    counted = (planner.blocks_skipped, planner.blocks_computed)
    layers[0](*[t.detach() for t in local], doc_ids=local_docs.clone())  # equal values, new micro-batch
    counted_twice = (planner.blocks_skipped, planner.blocks_computed)
    # the first micro-batch again after a later one (a pipeline schedule's backward recompute): its plans were kept
    layers[0](*[t.detach() for t in local], doc_ids=local_docs)
    got = [_gather_window(t, world, load_balance) for t in (out.detach(), *(t.grad for t in local))]
    want = _reference(q, k, v, dout, docs)
    return {
        "max_diff": {name: float((g - w).abs().max()) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)},
        "second_layer_equal": bool(torch.equal(second, out.detach())),
        "counted_once": counted,
        "counted_twice": counted_twice,
        "counted_after_return": (planner.blocks_skipped, planner.blocks_computed),
        "expected_skips": _expected_skips(docs, world, rank, load_balance),
    }


def _run_all(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(world)))
    return {case: _case(rank, world, group, *case) for case in CASES}


@functools.cache
def _results(world: int) -> list[dict]:
    return run_distributed(_run_all, world)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'lb' if c[1] else 'nolb'}")
def test_ring_attention_with_documents_matches_full_window_sdpa(world: int, case: tuple) -> None:
    for rank, result in enumerate(_results(world)):
        diffs = result[case]["max_diff"]
        print(f"cp={world} {case} rank {rank}: max |diff| {diffs}")
        assert all(diff <= ATOL for diff in diffs.values()), f"rank {rank}: {diffs} (atol {ATOL})"
        assert result[case]["second_layer_equal"]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'lb' if c[1] else 'nolb'}")
def test_planner_skips_fully_masked_blocks_once_per_micro_batch(world: int, case: tuple) -> None:
    results = [result[case] for result in _results(world)]
    for rank, result in enumerate(results):
        skipped = result["expected_skips"]
        # two layers and the checkpoint recompute share one doc_ids tensor: planned (and counted) once
        assert result["counted_once"] == (skipped, world - skipped), f"rank {rank}"
        assert result["counted_twice"] == (2 * skipped, 2 * (world - skipped)), f"rank {rank}"
        assert result["counted_after_return"] == result["counted_twice"], (
            f"rank {rank}: a live micro-batch planned again"
        )
    total = sum(result["expected_skips"] for result in results)
    print(f"cp={world} {case}: {total} of {world * world} (rank, block) pairs skipped per micro-batch")
    assert total > 0
