"""Context parallel's sequence layout and ring attention's block plans.

Layout (cp = the CP degree): every rank holds seq_len / cp tokens of every sequence. With load
balancing the sequence is cut into 2 * cp chunks and rank r holds chunk r and its mirror
2*cp-1-r, so every rank gets the same amount of causal work.

A block plan says which part of a K/V block a rank's queries see (``ring_attention_math._BlockPlan``).
``RingAttentionPlanner`` holds them for every RingAttention of one model: causal plans depend on
the local seqlen only (host ints, once per shape); block-causal plans depend on the micro-batch's
documents, so they are built once per micro-batch (kept while its doc_ids tensor lives) and shared
by every layer and by the activation-checkpoint recompute.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from torchtitan.distributed.context_parallel.ring_attention_math import _BlockPlan, _plan_block, plan_document_blocks
from torchtitan.distributed.context_parallel.ring_comms import _all_gather


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


class RingAttentionPlanner:
    """Block plans for this rank's queries against every rank's K/V block (plans[j] for block j).

    One planner serves every RingAttention of a model (``apply_cp`` creates it), so the documents
    of a micro-batch are gathered once, and planned once per sliding window (None: full causal
    context) that the model's layers use, not once per layer.

    Attributes:
        blocks_computed: block-causal attention only: this rank's (query shard, K/V block) pairs
            planned for computing, summed over micro-batches and the windows planned for each (cp
            per micro-batch and window in all, with blocks_skipped); not counted per layer or recompute.
        blocks_skipped: the same for pairs skipped because no token of any batch row sees any
            key of the block (every query's own document starts later, is in its past, or lies
            beyond the window).
    """

    def __init__(self, cp_group: dist.ProcessGroup, *, load_balance: bool):
        self.cp_group, self.load_balance = cp_group, load_balance
        self._causal: dict[tuple[int, int | None], list[_BlockPlan | None]] = {}  # (local seqlen, window) -> plans
        # Per live micro-batch doc_ids tensor (keyed by id, dropped by a weak reference when the tensor
        # dies): every rank's gathered copy and its plans per window. Every layer, and the
        # activation-checkpoint recompute, passes the same tensor object; a pipeline schedule runs
        # several micro-batches' forwards before their backwards, so every micro-batch in flight keeps
        # its plans (op-level AC refuses a recompute that plans again: ops its forward did not run).
        self._docs: dict[int, tuple[weakref.ref, int, torch.Tensor, dict[int | None, list[_BlockPlan | None]]]] = {}
        self.blocks_computed = 0
        self.blocks_skipped = 0

    def _positions(self, local_seqlen: int) -> list[list[int]]:
        """Every rank's global positions for a local seqlen (all ranks hold equally many tokens)."""
        cp = self.cp_group.size()
        if local_seqlen * cp % (2 * cp if self.load_balance else cp) != 0:
            raise ValueError(
                f"ring attention got a local seqlen of {local_seqlen} on context_parallel_degree = {cp} "
                f"with load_balance = {self.load_balance}: with load balancing each rank holds two equal "
                "chunks, so the local seqlen must be even; shard inputs with "
                "compute_cp_positions(training.seq_len, ...) and shard_sequence"
            )
        return [cp_position_list(local_seqlen * cp, cp, r, self.load_balance) for r in range(cp)]

    def causal_plans(self, local_seqlen: int, window: int | None = None) -> list[_BlockPlan | None]:
        """Causal (windowed) plans from the global positions: host ints, once per (local seqlen, window); fake-safe."""
        key = (local_seqlen, window)
        if key not in self._causal:
            positions = self._positions(local_seqlen)
            mine = positions[self.cp_group.rank()]
            self._causal[key] = [_plan_block(mine, theirs, window) for theirs in positions]
        return self._causal[key]

    def document_plans(self, doc_ids: torch.Tensor, window: int | None = None) -> list[_BlockPlan | None]:
        """Block-causal plans for this rank's doc_ids (bs, local_seqlen): gathered once per tensor, planned
        once per (tensor, window).

        Raises:
            NotImplementedError: doc_ids is a fake tensor (the memory estimator): plans need its values.
        """
        if is_fake(doc_ids):
            raise NotImplementedError(
                "ring attention plans block_causal masks from the document ids' values, which a fake "
                "tensor does not have: the memory estimator cannot model context parallel with "
                "model.attn_mask_type = 'block_causal'; estimate with context_parallel_degree = 1 or "
                "model.attn_mask_type = 'causal'"
            )
        key = id(doc_ids)
        entry = self._docs.get(key)
        if entry is None or entry[0]() is not doc_ids or entry[1] != doc_ids._version:
            # a new micro-batch: every rank gathers its documents once
            docs = self._docs
            all_docs = _all_gather(doc_ids, self.cp_group)  # (cp, bs, s): every rank's documents
            entry = (weakref.ref(doc_ids, lambda _: docs.pop(key, None)), doc_ids._version, all_docs, {})
            docs[key] = entry
        _, _, all_docs, doc_plans = entry
        if window not in doc_plans:
            positions = torch.tensor(self._positions(doc_ids.shape[1]), device=doc_ids.device)  # (cp, s)
            plans = plan_document_blocks(doc_ids, all_docs, positions[self.cp_group.rank()], positions, window)
            skipped = sum(plan is None for plan in plans)
            self.blocks_skipped += skipped
            self.blocks_computed += len(plans) - skipped
            doc_plans[window] = plans
        return doc_plans[window]
