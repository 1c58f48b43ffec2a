"""The seams through which a run takes part in something wider than its own ranks: replica groups that train one
model together (fault tolerance). Each seam is what that does for one part of the loop, with the null object the
engine uses for a run of one group:

- ``StepAgreement`` (the loop): which step this attempt trains, whether it is applied; ``OneGroup``.
- ``GradientSync`` (the step): sums and averages over the groups inside a step; ``LocalGradients``.
- ``StopPolicy`` (stop signals): when a signal may end the run, and who saves; ``StopAnytime``.
- ``CheckpointShare`` (the checkpointer): who writes a shared folder, what it holds beside the trainer's own;
  ``OwnCheckpoints``.
- ``StepFields`` (metrics): fields each logged step's record gains; ``NoFields``.

A feature that fills them builds one object that is all five (``GroupSeams``: the registry's ``group_seams``
slot); each consumer is handed only the seam it uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from torchtitan.distributed.mesh import OuterSum


@dataclass(frozen=True)
class StepAttempt:
    step: int
    """The step this attempt trains: the committed steps + 1 (a healed replica group jumps here)."""
    data_moved: bool
    """The loader's position was replaced (a heal): the trainer makes its data iterator again."""


class StepAgreement(Protocol):
    """The loop's step agreed with the other groups, in the order the loop calls it: ``start_step``, (the step),
    ``commit``, ``finish_step``; ``report_end`` after the last one."""

    @property
    def step(self) -> int:
        """The committed steps."""

    def resume_at(self, step: int) -> None:
        """The run resumed from a checkpoint of ``step``."""

    def start_step(self) -> StepAttempt:
        """Join the step (a restarted group heals here, before its forward pass)."""

    def commit(self, step: int) -> bool:
        """Whether step ``step`` is applied."""

    def finish_step(self, committed: bool) -> bool:
        """After the commit; returns whether the data position moved (the loop makes its iterator again)."""

    def report_end(self, step: int) -> None:
        """The run's last step is done."""

    def close(self) -> None: ...


class GradientSync(Protocol):
    """What a step shares with the other groups: sums inside it, the gradients after backward, the update."""

    outer_sum: OuterSum | None
    """Sums over the live groups inside a step (token counts, expert loads), or None where there are none."""
    loss_max: torch.Tensor | None
    """This rank's loss, the max over the groups, of the last step (None: the rank's own)."""

    def reduce_gradients(
        self, finish_gradients: Callable[[], list[nn.Parameter]], loss: torch.Tensor
    ) -> tuple[torch.Tensor, list[nn.Parameter] | None]:
        """After backward: (the loss to log, the parameters whose gradients were averaged across the groups, or
        None when nothing was averaged and clipping finds them itself)."""

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step of a committed step."""


class StopPolicy(Protocol):
    """When a stop signal may end the run, and whether this group saves before it leaves."""

    @property
    def can_stop(self) -> bool:
        """A stop signal may end the run after the current step."""

    def before_stop(self, step: int) -> None:
        """A stop signal ends the run after ``step``: raise ``RunStopped`` if this group must leave unsaved."""


class CheckpointShare(Protocol):
    """How this run's checkpoints are shared with the other groups (the checkpointer's builder reads it)."""

    @property
    def writes_checkpoints(self) -> bool:
        """This group writes the checkpoint (of several groups sharing one folder, one does)."""

    @property
    def sets_aside_later(self) -> bool:
        """A resume from an earlier checkpoint sets later ones aside (a group sharing a folder with live ones
        must not)."""

    def data_state(self, data_loader: Any) -> Stateful:
        """What a checkpoint saves as the data position (the loader's, or every group's)."""

    def checkpoint_state(self) -> dict[str, Stateful]:
        """Parts of a full checkpoint beside the trainer's own."""


class StepFields(Protocol):
    """Fields each logged step's record gains."""

    def metrics(self, group_batch: int) -> tuple[dict[str, Any], dict[str, float]] | None:
        """The log record's fields and TensorBoard scalars (``group_batch``: samples of one group's step)."""


class GroupSeams(StepAgreement, GradientSync, StopPolicy, CheckpointShare, StepFields, Protocol):
    """What the ``group_seams`` slot's builder returns: one object that is every seam above."""


class OneGroup:
    """``StepAgreement`` of a run of one group: every step commits."""

    def __init__(self) -> None:
        self._step = 0

    @property
    def step(self) -> int:
        return self._step

    def resume_at(self, step: int) -> None:
        self._step = step

    def start_step(self) -> StepAttempt:
        return StepAttempt(step=self._step + 1, data_moved=False)

    def commit(self, step: int) -> bool:
        self._step = step
        return True

    def finish_step(self, committed: bool) -> bool:
        return False

    def report_end(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class LocalGradients:
    """``GradientSync`` of a run of one group: nothing crosses the world."""

    outer_sum: OuterSum | None = None
    loss_max: torch.Tensor | None = None

    def reduce_gradients(
        self, finish_gradients: Callable[[], list[nn.Parameter]], loss: torch.Tensor
    ) -> tuple[torch.Tensor, list[nn.Parameter] | None]:
        return loss, None

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


class StopAnytime:
    """``StopPolicy`` of a run of one group: any step may be the last, and it saves."""

    can_stop = True

    def before_stop(self, step: int) -> None:
        pass


class OwnCheckpoints:
    """``CheckpointShare`` of a run of one group: it writes its folder and saves its loader's position."""

    writes_checkpoints = True
    sets_aside_later = True

    def data_state(self, data_loader: Any) -> Any:
        return data_loader

    def checkpoint_state(self) -> dict[str, Stateful]:
        return {}


class NoFields:
    """``StepFields`` that add nothing."""

    def metrics(self, group_batch: int) -> None:
        return None
