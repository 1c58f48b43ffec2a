"""Semi-synchronous fault tolerance: torchft's LocalSGD and DiLoCo behind the trainer's ``Replicas`` seam.

Each replica group trains alone (its own data, its own optimizer) and every ``sync_steps`` steps the groups
synchronize inside the optimizer step, through torchft's hooks on it:

* ``local_sgd``: the weights are averaged over the live groups;
* ``diloco``: the change of the weights since the last synchronization (the pseudo-gradient) is averaged and
  applied to the last synchronized weights by the outer optimizer (SGD with ``outer_lr``, ``outer_momentum``,
  ``outer_nesterov``), whose state is part of the checkpoint.

A synchronization is torchft's quorum + average + commit: a group that joins heals there (weights, optimizer,
lr schedule, data position, DiLoCo's outer state, the step), one that fails makes it uncommitted (LocalSGD keeps
each group's weights, DiLoCo goes back to the last synchronized ones). Checkpoints are written just after a
synchronization, by every group into its own folder: the inner optimizers' states differ between groups, and a
resumed group must get its own back to continue bit for bit.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from torchtitan.checkpointing.state import OptimizerState
from torchtitan.features.fault_tolerance.errors import ReplicaGroupsFailed, require_torchft, short_reason
from torchtitan.features.fault_tolerance.replicas import Replicas, StepAttempt

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.checkpoint.stateful import Stateful

    from torchtitan.config.sections.fault_tolerance import FaultTolerance

logger = logging.getLogger(__name__)


class SemiSyncReplicas(Replicas):
    """One rank's LocalSGD / DiLoCo; the algorithm is made at ``resume_at`` (DiLoCo copies the weights it
    starts from, so after the checkpoint is loaded)."""

    def __init__(self, ft: FaultTolerance, *, view: nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any):
        super().__init__(ft, **kwargs)
        self.view, self.optimizer = view, optimizer
        self.outer = None
        if ft.semi_sync_method == "diloco":
            self.outer = torch.optim.SGD(
                view.parameters(), lr=ft.outer_lr, momentum=ft.outer_momentum, nesterov=ft.outer_nesterov
            )
        self._step = 0  # this group's trainer steps (a heal moves it to the peer's)
        self.algorithm: Any = None
        self.last_commit = time.monotonic()
        self._before: tuple[int, int] = (0, 0)  # (heals, commits) when the step started
        self._moved = False
        # the step travels with a heal: a restarted group continues at the live groups' step
        self.manager.register_state_dict_fn("trainer_step", self._jump, lambda: {"step": self._step + 1})

    @property
    def step(self) -> int:
        return self._step

    @property
    def can_stop(self) -> bool:
        """A stop waits for the next synchronization, where a checkpoint holds what every group agreed."""
        return self._step % self.ft.sync_steps == 0

    writes_checkpoints = True  # each group its own folder (launch/run_folder.py checkpoint_root)

    def checkpoint_state(self) -> dict[str, Stateful]:
        return {} if self.outer is None else {"outer_optimizer": OptimizerState(self.view, self.outer)}

    def resume_at(self, step: int) -> None:
        """Training starts after ``step`` (a synchronization): the quorum counts synchronizations."""
        require_torchft()
        from torchft.local_sgd import DiLoCo, LocalSGD

        self._step = step
        syncs = step // self.ft.sync_steps
        self.manager.load_state_dict({"step": syncs, "batches_committed": self.manager.batches_committed()})
        every = self.ft.sync_steps
        if self.outer is not None:
            self.algorithm = DiLoCo(self.manager, [self.view], self.optimizer, self.outer, sync_every=every)
        else:
            self.algorithm = LocalSGD(self.manager, self.view, self.optimizer, sync_every=every)
        self.algorithm.__enter__()  # its hooks on the optimizer, until close()

    def _jump(self, state: dict[str, int]) -> None:
        self._step = state["step"] - 1  # the peer is inside that step's optimizer step, as this group is
        self._moved = self._moved or self.heal.data_moved

    # ---- the step (no communication but at a synchronization) -----------------------------------

    def start_step(self) -> StepAttempt:
        self._before = (self.heal.healed, self.manager.current_step())
        return StepAttempt(step=self._step + 1, data_moved=False)  # a heal comes inside the step (finish_step)

    def average(self, params: list[torch.nn.Parameter], loss: torch.Tensor) -> torch.Tensor:
        """Nothing between synchronizations: the loss logged is this group's own."""
        self.loss_max = loss.detach().float()
        return loss

    def commit(self, step: int) -> bool:
        return True  # the inner step is always applied; a synchronization commits on its own

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The inner step; at a synchronization torchft's hooks run the quorum, average and commit inside it."""
        try:
            optimizer.step()
        except ReplicaGroupsFailed:
            raise
        except Exception as e:  # torchft's quorum RPC: the lighthouse gone, or no quorum in time
            raise ReplicaGroupsFailed(
                f"fault tolerance: the synchronization after step {self._step + 1} failed: {short_reason(e)}; is the "
                f"lighthouse at {self.lighthouse} up, with enough replica groups?"
            ) from None

    def finish_step(self, committed: bool) -> bool:
        """After the step: at a synchronization, tell it and exchange every group's data position."""
        healed = self.heal.healed != self._before[0]
        self._step += 1
        if self._step % self.ft.sync_steps == 0:
            self._tell_sync(self.manager.current_step() > self._before[1], healed)
            self.members = self.positions.exchange(self.manager) or self.members
        moved, self._moved = self._moved, False
        return moved

    def _tell_sync(self, committed: bool, healed: bool) -> None:
        now = time.monotonic()
        if committed:
            self.last_commit = now
        elif now - self.last_commit > self.ft.quorum_timeout_seconds:
            raise ReplicaGroupsFailed(
                f"fault tolerance: no synchronization committed for {now - self.last_commit:.0f} s (fault_tolerance."
                f"quorum_timeout_seconds = {self.ft.quorum_timeout_seconds}): "
                f"{short_reason(self.manager.errored())}; start the missing replica groups or lower min_replica_size"
            )
        if not self.log:
            return
        how = "averaged the weights" if self.outer is None else "applied the averaged weight change (outer step)"
        source = f"; healed from replica group {self.heal.last_source} first" if healed else ""
        if committed:
            logger.info(
                "fault tolerance: step %d: %s synchronization %d %s over %d replica group(s)%s",
                self._step, self.ft.semi_sync_method, self.manager.current_step(), how,
                self.manager.num_participants(), source,
            )  # fmt: skip
        else:
            logger.warning(
                "fault tolerance: step %d: %s synchronization not committed (%s); %s",
                self._step, self.ft.semi_sync_method, short_reason(self.manager.errored()),
                "each group keeps its own weights" if self.outer is None else "back to the last synchronized weights",
            )  # fmt: skip

    def close(self) -> None:
        if self.algorithm is not None:
            self.algorithm.__exit__(None, None, None)
        super().close()
