"""Every replica group's data position, known to every group.

A group reads its own streams of the global batch (its data-parallel ranks are ``replica_id * dp + r`` of
``group_size * dp``), so with every group alive a step reads exactly HSDP's samples. The loaders' states are
exchanged between the groups after every step (two small all-reduces of this group rank's JSON state), so:

* a group that dies and restarts gets its own position back from a live peer when it heals: it goes on
  where it stopped, no window skipped or trained twice (its streams then run behind the others');
* the shared checkpoint, written by one group, holds every group's streams: after a full stop each group
  (or any other data-parallel layout) resumes its own.

A discarded step is retried on the same data: the position is rewound to the step's start.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ReduceOp

from torchtitan.datasets.hf_datasets import compute_stream_groups, merge_data_states

if TYPE_CHECKING:
    from torchft import Manager


class DataPositions:
    """This group rank's view of every group's loader state; the checkpoint's data loader under fault tolerance.

    ``dp_rank`` / ``dp_degree``: this rank's data-parallel rank and degree inside its group; ``batch_size`` and
    ``accum``: training's local batch size and gradient-accumulation steps (the streams of one dp rank).
    """

    def __init__(
        self,
        loader: Any,
        *,
        replica_id: int,
        group_size: int,
        dp_rank: int,
        dp_degree: int,
        batch_size: int,
        accum: int,
    ):
        self.loader = loader
        self.replica_id, self.group_size = replica_id, group_size
        self.dp_rank, self.dp_degree, self.batch_size, self.accum = dp_rank, dp_degree, batch_size, accum
        self.known: dict[int, str] = {}  # replica id -> its JSON loader state (at this rank's dp rank in it)
        self._snapshot: str | None = None

    # ---- the step ------------------------------------------------------------------------------

    def snapshot(self, *, moved: bool) -> None:
        """Remember where the step starts (``rewind`` goes back there): the position the last exchange sent,
        unless the loader has moved since (a heal, or no exchange yet)."""
        if moved or self._snapshot is None:
            self._snapshot = json.dumps(self.loader.state_dict())

    def rewind(self) -> None:
        """Back to the step's start: a discarded step is retried on the same windows."""
        assert self._snapshot is not None, "rewind without a snapshot"
        self.loader.load_state_dict(json.loads(self._snapshot))

    def exchange(self, manager: Manager) -> tuple[int, ...] | None:
        """Share this group's position with the live groups and learn theirs; returns the groups that took part,
        or None if a peer failed mid-way (the records stay as they were: torchft's all-reduces after an error
        leave garbage)."""
        self._snapshot = json.dumps(self.loader.state_dict())  # also where the next step starts
        mine = self._snapshot.encode()
        lengths = torch.zeros(self.group_size, dtype=torch.int64)
        lengths[self.replica_id] = len(mine)
        manager.allreduce(lengths, reduce_op=ReduceOp.SUM).wait()
        if manager.errored():
            return None
        payload = torch.zeros(self.group_size, int(lengths.max()), dtype=torch.uint8)  # (groups, bytes)
        payload[self.replica_id, : len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        manager.allreduce(payload, reduce_op=ReduceOp.SUM).wait()
        if manager.errored():
            return None
        members = tuple(group for group, length in enumerate(lengths.tolist()) if length)
        for group in members:
            self.known[group] = payload[group, : lengths[group]].numpy().tobytes().decode()
        return members

    # ---- healing -------------------------------------------------------------------------------

    def records(self) -> dict[int, str]:
        """What a healing group receives: every group's last exchanged position."""
        return dict(self.known)

    def adopt(self, records: dict[int, str]) -> bool:
        """A peer's records; this group's own one (if the peer has it) becomes the loader's position.

        Returns whether the loader's position changed (its iterator must then be made again).
        """
        self.known.update(records)
        own = records.get(self.replica_id)
        if own is None:  # a group that never trained before: its streams start where its own state says
            return False
        self.loader.load_state_dict(json.loads(own))
        return True

    # ---- the checkpoint (checkpointing/state.py's DataLoaderState calls these) --------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's streams in every group whose position is known: one group's checkpoint resumes all."""
        others = [json.loads(text) for group, text in self.known.items() if group != self.replica_id]
        return merge_data_states([self.loader.state_dict(), *others])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A merged state (every group's streams): this group's loader takes its own; the others are kept, so
        this group's next checkpoint still holds the streams of groups that are not back yet."""
        self.loader.load_state_dict(state)
        streams = state["streams"]
        for group in range(self.group_size):
            ids = self._streams_of(group)
            if group != self.replica_id and all(str(s) in streams for s in ids):
                self.known[group] = json.dumps({**state, "streams": {str(s): streams[str(s)] for s in ids}})

    def _streams_of(self, group: int) -> list[int]:
        """The streams this rank's counterpart in replica group ``group`` reads."""
        rank, degree = group * self.dp_degree + self.dp_rank, self.group_size * self.dp_degree
        return [s for g in compute_stream_groups(rank, degree, self.batch_size, self.accum) for s in g]
