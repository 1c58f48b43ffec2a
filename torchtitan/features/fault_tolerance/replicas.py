"""The trainer's side of fault tolerance: ``Replicas`` (what both modes share) and ``ReplicaGroups``, the
synchronous mode (one per rank; semi_sync.py has the other).

Each step, in this order on every live group (the cross-group collectives must pair up):

1. ``start_step``: the quorum (a restarted group heals here, before its forward pass), then one all-reduce of
   each group's config and weights fingerprints, which says who is in the step and that they run the same
   config on the same weights (a group whose weights differ stops: fingerprint.py);
2. ``sum_`` (the world's ``outer_sum``): token counts of block-causal data, an MoE expert-bias update's counts;
3. ``average``: after backward (FSDP's reduce-scatter inside the group done), the gradients and the loss are
   averaged over the live groups, in buckets; clipping then sees gradients equal in every group, so the
   norm a group computes over its own shard axes is the global norm, as under HSDP;
4. ``commit``: torchft's ``should_commit``; the optimizer and lr schedule step only on commit;
5. ``finish_step``: a discarded step rewinds the data; every group's data position is exchanged.

Averaging per live group gives each group's mean loss the same weight: the effective global batch is the
live groups' batches, and its loss is their mean (both logged). Failures torchft records (a peer gone
mid-all-reduce) discard the step; what cannot go on (no lighthouse, no quorum, nothing committed for
``quorum_timeout_seconds``) raises ``ReplicaGroupsFailed`` with one line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ReduceOp

from torchtitan.components.group_seams import StepAttempt
from torchtitan.components.run_control import RunStopped
from torchtitan.features.fault_tolerance.errors import ReplicaGroupsFailed, short_reason
from torchtitan.features.fault_tolerance.fingerprint import agreed_value, group_fingerprint
from torchtitan.features.fault_tolerance.heal import weights_digest
from torchtitan.features.fault_tolerance.lighthouse import reachable

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from torchtitan.config.sections.fault_tolerance import FaultTolerance
    from torchtitan.distributed.mesh import OuterSum
    from torchtitan.features.fault_tolerance.heal import HealState
    from torchtitan.features.fault_tolerance.manager import ManagerHandle
    from torchtitan.features.fault_tolerance.positions import DataPositions

logger = logging.getLogger(__name__)

BUCKET_BYTES = 32 * 1024 * 1024  # gradients are averaged in flat buckets of at most this size (one extra buffer)


class Replicas:
    """What both modes share: the Manager, the heal state, every group's data position, the live groups.

    Is every replica-group seam (``GroupSeams``, components/group_seams.py) with the subclasses' quorum and commit.
    """

    outer_sum: OuterSum | None = None
    """Sums over the live groups inside a step (``WorldMesh``'s OuterSum), where the mode has them."""

    def __init__(
        self,
        ft: FaultTolerance,
        *,
        handle: ManagerHandle,
        heal: HealState,
        positions: DataPositions,
        lighthouse: str,
        fingerprint: int,
        log: bool,
        sets_aside_later: bool,
    ):
        self.ft, self.handle, self.heal, self.positions = ft, handle, heal, positions
        self.sets_aside_later = sets_aside_later  # see setup._sets_aside_later
        self.manager = handle.manager
        self.lighthouse, self.fingerprint, self.log = lighthouse, fingerprint, log
        self.members: tuple[int, ...] = ()  # the live groups (of this step, or the last synchronization), by id
        self.loss_max: torch.Tensor | None = None  # this rank's loss, the max over the groups (last step)

    def metrics(self, group_batch: int) -> tuple[dict[str, int], dict[str, float]]:
        """The log record's fields: the live groups and the global batch they trained (``group_batch``
        samples each)."""
        groups = len(self.members)
        return {"replica_groups": groups, "global_batch_samples": groups * group_batch}, {"ft/replica_groups": groups}

    def data_state(self, data_loader: Any) -> DataPositions:
        """A shared checkpoint saves every group's data position, so it resumes all of them."""
        return self.positions

    def reduce_gradients(
        self, finish_gradients: Callable[[], list[torch.nn.Parameter]], loss: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.nn.Parameter]]:
        """The gradients and loss of every live group, averaged (clipping then sees them as HSDP's)."""
        params = finish_gradients()
        return self.average(params, loss), params

    def average(self, params: list[torch.nn.Parameter], loss: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def before_stop(self, step: int) -> None:
        """Of the groups sharing a checkpoint folder, only the one that writes it saves before stopping."""
        if not self.writes_checkpoints:
            raise RunStopped(
                f"stopped by a signal after step {step}: replica group {self.members[0]} (the lowest live one) keeps "
                "the shared checkpoint; this group leaves the quorum, the others go on"
            )

    @property
    def writes_checkpoints(self) -> bool:
        raise NotImplementedError

    def checkpoint_state(self) -> dict[str, Stateful]:
        """Parts of a full checkpoint beside the trainer's own (the DiLoCo outer optimizer)."""
        return {}

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step of a committed step (semi-sync: a synchronization may run inside it)."""
        optimizer.step()

    def report_end(self, step: int) -> None:
        """The last line of a group: where it ended and a digest of its weights (equal in every group)."""
        digest = weights_digest(self.heal.view)
        if self.log:
            logger.info(
                "fault tolerance: replica group %d done at step %d with groups %s; weights digest %s",
                self.ft.replica_id,
                step,
                list(self.members),
                digest,
            )

    def close(self) -> None:
        self.handle.close()


class ReplicaGroups(Replicas):
    """Quorum, averaging and commit of one rank of replica group ``ft.replica_id`` (the synchronous mode)."""

    def __init__(self, ft: FaultTolerance, **kwargs: Any):
        super().__init__(ft, **kwargs)
        self.outer_sum = self.sum_
        self.last_commit = time.monotonic()
        self.discarded: str | None = None  # why the last attempt was discarded, told with the next quorum
        self.heal_target: tuple[int, int] | None = None  # (quorum id, step) of a heal that failed

    @property
    def step(self) -> int:
        """The committed steps (the quorum's, so a healed group's are the live ones')."""
        return self.manager.current_step()

    @property
    def can_stop(self) -> bool:
        """A stop signal may end the run after any committed step."""
        return True

    def resume_at(self, step: int) -> None:
        """The trainer resumed from a checkpoint of ``step``: the quorum counts from there."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    # ---- 1. quorum -----------------------------------------------------------------------------

    def start_step(self) -> StepAttempt:
        """Join this step's quorum (healing if behind) and learn who is in it."""
        healed, start = self.heal.healed, time.perf_counter()
        step = self.manager.current_step() + 1
        try:
            self.manager.start_quorum()
        except ReplicaGroupsFailed:
            raise
        except Exception as e:  # torchft's RPC errors: the lighthouse is gone, or no quorum formed in time
            raise self._quorum_failure(step, e) from None
        self._check_heal(healed)
        members = self._presence()
        moved = self.heal.healed != healed and self.heal.data_moved
        if self.heal.healed != healed and self.log:
            logger.info(
                "fault tolerance: replica group %d healed from group %s at step %d in %.2f s (weights, optimizer, "
                "lr schedule, %s)",
                self.ft.replica_id,
                self.heal.last_source,
                self.manager.current_step(),
                time.perf_counter() - start,
                "its own data position"
                if moved
                else "no data position recorded for it: its streams go on as they were",
            )
        self._tell_members(members, self.manager.current_step() + 1)
        self.positions.snapshot(moved=moved)
        return StepAttempt(step=self.manager.current_step() + 1, data_moved=moved)

    def _check_heal(self, healed_before: int) -> None:
        """A heal that was due but failed (its source died mid-transfer) is retried at the next quorum; once no
        live group holds the step it was healing to, going on would silently train from an older state."""
        event, target = self.handle.events.latest, self.heal_target  # (quorum id, the quorum's step)
        if self.heal.healed != healed_before:
            self.heal_target = None
            return
        if event is None:
            return
        if self.manager.current_step() < event[1]:  # behind this quorum and not healed: the transfer failed
            if self.manager.errored() is not None and target != event:
                self.heal_target = event
                if self.log:
                    logger.warning(
                        "fault tolerance: replica group %d could not heal to step %d (its source failed "
                        "mid-transfer: %s); retrying at the next quorum",
                        self.ft.replica_id,
                        event[1],
                        short_reason(self.manager.errored()),
                    )
            return
        if target is not None and event[0] != target[0] and event[1] < target[1]:
            raise self._heal_failed(f"no live group holds that step any more (the quorum is at step {event[1]})")

    def _heal_failed(self, why: str) -> ReplicaGroupsFailed:
        """The one line of a heal whose source failed mid-transfer and that nothing can retry (``why``)."""
        return ReplicaGroupsFailed(
            f"fault tolerance: replica group {self.ft.replica_id} was healing to step {self.heal_target[1]} when its "
            f"source failed, and {why}; restart the replica groups: they resume from the last checkpoint"
        )

    def _presence(self) -> tuple[int, ...]:
        """One all-reduce of each group's config and weights fingerprints in its own slots: the step's groups,
        checked alike (the same config; the same weights, fingerprint.py)."""
        n, me = self.ft.group_size, self.ft.replica_id
        slots = torch.zeros(2 * n, dtype=torch.int64)
        step = self.manager.current_step() + 1  # the same in every group of the quorum: the same slice
        slots[me], slots[n + me] = self.fingerprint, group_fingerprint(self.heal.view, step)
        self.manager.allreduce(slots, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored():
            return self.members  # a peer failed right after the quorum: this attempt will not commit
        values = slots.tolist()
        members = tuple(i for i, v in enumerate(values[:n]) if v)
        if values[me] != values[members[0]]:
            raise ReplicaGroupsFailed(
                f"fault tolerance: replica group {me} runs another config than group {members[0]} "
                "(model, training, optimizer, parallel layout or number of ranks differ); launch every group with "
                "the same command but for --fault_tolerance.replica_id"
            )
        self._check_weights(members, values[n:])
        return members

    def _check_weights(self, members: tuple[int, ...], weights: list[int]) -> None:
        """Groups whose weights differ from what most live groups hold (a tie: the lowest group's) stop, in one line;
        the others go on without them (their next all-reduce with it fails, and the step is retried)."""
        agreed = agreed_value(members, weights)
        apart = [g for g in members if weights[g] != agreed]
        if not apart:
            return
        me, step = self.ft.replica_id, self.manager.current_step() + 1
        same = [g for g in members if weights[g] == agreed]
        if me in apart:
            raise ReplicaGroupsFailed(
                f"fault tolerance: replica group {me}'s weights differ from replica group(s) {same} at the start of "
                f"step {step} (weights fingerprint {weights[me]:x}, theirs {agreed:x}): a silent fault changed them; "
                "this group stops and the others go on: restart it with the same command and it heals from them"
            )
        if self.log:
            logger.warning(
                "fault tolerance: replica group(s) %s hold other weights than this group at the start of step %d: "
                "they stop, the others go on",
                apart,
                step,
            )

    def _tell_members(self, members: tuple[int, ...], step: int) -> None:
        """One line when the step's groups change or the last attempt was discarded."""
        if members == self.members and self.discarded is None:
            return
        if self.log:
            left = sorted(set(self.members) - set(members))
            joined = sorted(set(members) - set(self.members)) if self.members else []
            change = "".join([f", {left} left" if left else "", f", {joined} joined" if joined else ""])
            batch = f"global batch {len(members)}/{self.ft.group_size} of the full one"
            if self.discarded is not None:
                logger.warning(
                    "fault tolerance: step %d retried with replica groups %s%s (%s): the last attempt was discarded: %s",
                    step, list(members), change, batch, self.discarded,
                )  # fmt: skip
            else:
                logger.info("fault tolerance: step %d on replica groups %s%s (%s)", step, list(members), change, batch)
        self.members, self.discarded = members, None

    def _quorum_failure(self, step: int, error: BaseException) -> ReplicaGroupsFailed:
        gone = reachable(self.lighthouse)
        if gone is not None:
            return ReplicaGroupsFailed(
                f"fault tolerance: lost the lighthouse at {self.lighthouse} before step {step}: {gone}; no quorum can "
                "form without it (the last checkpoint is kept): restart the lighthouse, then the replica groups"
            )
        return ReplicaGroupsFailed(
            f"fault tolerance: no quorum for step {step} within {self.ft.quorum_timeout_seconds} s "
            f"(fault_tolerance.quorum_timeout_seconds): {short_reason(error)}; are as many replica groups up as the "
            "lighthouse's --min_replicas?"
        )

    # ---- 2, 3. sums and averages over the live groups ---------------------------------------------

    def sum_(self, tensor: torch.Tensor) -> int:
        """Sum ``tensor`` in place over the live groups; returns their number (``WorldMesh.outer_sum``)."""
        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return self.manager.num_participants()

    @torch.no_grad()
    def average(self, params: list[torch.nn.Parameter], loss: torch.Tensor) -> torch.Tensor:
        """Average every gradient (local shards) over the live groups; returns ``loss`` averaged likewise.

        A parameter without a gradient averages zeros (every group issues the same collectives). Also keeps
        the max over the groups of this rank's loss (``loss_max``).
        """
        average_in_buckets(params, lambda flat: self.manager.allreduce(flat).wait())  # AVG over the participants
        mean, top = loss.detach().float().clone(), loss.detach().float().clone()
        self.manager.allreduce(mean).wait()
        self.manager.allreduce(top, reduce_op=ReduceOp.MAX).wait()
        self.loss_max = top
        return mean

    # ---- 4, 5. commit and the data ----------------------------------------------------------------

    def commit(self, step: int) -> bool:
        """Whether every live group agrees to apply step ``step``; raises once nothing committed for too long."""
        try:
            committed = self.manager.should_commit()
        except Exception as e:  # the group's own ManagerServer did not answer in time
            raise ReplicaGroupsFailed(f"fault tolerance: step {step}'s commit failed: {short_reason(e)}") from None
        now = time.monotonic()
        if committed:
            self.last_commit = now
            return True
        live, need = self.manager.num_participants(), self.ft.min_replica_size
        error = self.manager.errored()
        self.discarded = (
            f"{live} live replica group(s), fewer than fault_tolerance.min_replica_size = {need}"
            if error is None and live < need
            else short_reason(error)
        )
        if now - self.last_commit > self.ft.quorum_timeout_seconds:
            if self.heal_target is not None:  # a heal failed mid-transfer and no quorum came to retry it in time
                raise self._heal_failed(
                    "no live group served that step within fault_tolerance.quorum_timeout_seconds = "
                    f"{self.ft.quorum_timeout_seconds} ({self.discarded})"
                )
            raise ReplicaGroupsFailed(
                f"fault tolerance: no step committed for {now - self.last_commit:.0f} s (fault_tolerance."
                f"quorum_timeout_seconds = {self.ft.quorum_timeout_seconds}), stuck at step {step}: {self.discarded}; "
                "start the missing replica groups or lower fault_tolerance.min_replica_size"
            )
        return False

    def finish_step(self, committed: bool) -> bool:
        """After the commit: rewind a discarded step's data, exchange every group's data position.

        Returns whether the loader's position moved (rewound): the trainer makes its iterator again.
        """
        if not committed:
            self.positions.rewind()
        self.positions.exchange(self.manager)
        return not committed

    @property
    def writes_checkpoints(self) -> bool:
        """The lowest live replica id writes the shared checkpoint (every group knows the same members)."""
        return bool(self.members) and self.members[0] == self.ft.replica_id


@torch.no_grad()
def average_in_buckets(params: list[torch.nn.Parameter], allreduce: Callable[[torch.Tensor], object]) -> None:
    """Every gradient's local shard through ``allreduce`` (which averages a flat tensor in place), one bucket at a
    time (the memory estimator runs this with no collective, to track the bucket). A parameter without a gradient
    gets zeros: every group issues the same collectives."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
    for bucket in _buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket])  # (sum of numels,)
        allreduce(flat)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive runs of one dtype and device, each at most ``BUCKET_BYTES`` (a bigger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = out[-1] if out else None
        if last is None or (last[0].dtype, last[0].device) != (t.dtype, t.device) or size + nbytes > BUCKET_BYTES:
            out.append([t])
            size = nbytes
        else:
            last.append(t)
            size += nbytes
    return out
