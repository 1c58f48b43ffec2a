"""A per-step fingerprint of a replica group's weights: replica groups that drifted apart cannot go on silently.

In the synchronous mode every live group applies the same averaged gradients to the same weights, so their
weights are bit for bit equal at the start of every step. A group whose weights differ (a silent fault in
its memory or arithmetic, a stale group that rejoined without healing: the "split brain") trains on as if
it were right, and its checkpoints would carry it on. So each step the groups compare a fingerprint of
their weights, in the slots of the all-reduce that already says who is in the step (``ReplicaGroups``).

The fingerprint covers every weight, in turn: at step s each local shard of the weights and persistent
buffers gives the sum of its bytes read as 64-bit integers over its slice s mod ``SLICES`` (exact, and the same
in every group whatever the summation order: integer addition wraps), so one changed bit anywhere changes the
fingerprint within ``SLICES`` steps, and weights that differ everywhere (a group that drifted) at the first
step. Not a fixed sample: a corrupted element stays alone when the groups go on applying equal averaged
gradients, so a sample could miss it forever. A step reads 1/``SLICES`` of the weights; the per-tensor sums
are hashed on the host. Rank r of every group holds the same shards, and the ranks of a group add their
fingerprints in one small all-reduce, so every rank of a group sees the group's fingerprint and decides alike.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

SLICES = 16  # every weight is read once in this many steps
# Below 2**40, so the sum over a group of up to 2**23 ranks stays a positive int64 (0 marks an absent group).
_BITS = 40


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _slice_sum(tensor: torch.Tensor, piece: int) -> torch.Tensor:
    """The wrapping int64 sum of slice ``piece`` of ``tensor``'s bytes (the tail of < 8 bytes goes with slice 0)."""
    data = tensor.detach().reshape(-1).view(torch.uint8)  # reshape copies only a non-contiguous shard
    words = data.numel() // 8
    lo, hi = words * piece // SLICES * 8, words * (piece + 1) // SLICES * 8
    part = data[lo:hi]
    if part.storage_offset() % 8:  # int64 words need 8-byte alignment in the storage
        part = part.clone()
    total = part.view(torch.int64).sum()
    if piece == 0 and data.numel() > words * 8:
        total = total + data[words * 8 :].sum(dtype=torch.int64)
    return total


@torch.no_grad()
def weights_fingerprint(view: torch.nn.Module, step: int) -> int:
    """This rank's fingerprint of slice ``step`` mod SLICES of its local weights and buffers, in 1 .. 2**40 - 1."""
    piece = step % SLICES
    sums = [_slice_sum(_local(v), piece) for v in view.state_dict().values() if _local(v).numel()]
    data = torch.stack(sums).cpu().numpy().tobytes() if sums else b""
    digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return digest % ((1 << _BITS) - 1) + 1


def group_fingerprint(view: torch.nn.Module, step: int) -> int:
    """The replica group's fingerprint at ``step``: its ranks' summed (one all-reduce inside the group; none for
    one rank)."""
    mine = weights_fingerprint(view, step)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    total = torch.tensor([mine], dtype=torch.int64)  # a CPU tensor: the group's gloo backend carries it
    dist.all_reduce(total)
    return int(total.item())


def agreed_value(members: tuple[int, ...], values: list[int]) -> int:
    """The value most live groups hold; on a tie, the lowest group's among the tied (every group finds the same)."""
    counts = Counter(values[g] for g in members)
    top = max(counts.values())
    return next(values[g] for g in members if counts[values[g]] == top)
