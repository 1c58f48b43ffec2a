"""The step's seams: the declared interfaces through which optional features take part in a training step, and
the null object the engine uses where a feature is off (so the loop has no ``if feature is None`` branches).

- ``OuterSync``: the step's agreement with other replica groups (fault tolerance); off: ``SingleGroup``.
- ``OptimizerStep``: how gradients become an update (clip then step, or stepped during backward); default
  ``ClipAndStep``.
- ``StepPass``: how the forward/backward of a step's micro-batches runs (step replay runs it twice); default
  ``DirectPass``.
- ``AfterStep``: work after a committed step at its own schedule (validation, evaluation); off: none.
- ``NoStepHooks``: a family without per-step work (``spec.StepHooks``).
- ``PlanTerms``: what a feature changes in ``estimation.py --plan``'s per-rank terms and in the start summary; the
  base changes nothing.

And what a feature's builder reads (``Parts``: the engine's ``CoreParts`` is one) and writes to (``Metrics``),
declared here, below the features, so a feature names no engine type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from torchtitan.dtypes import to_dtype

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from torch.distributed.checkpoint.stateful import Stateful

    from torchtitan.checkpointing.scope import ModelScope
    from torchtitan.components.step import StepFunction
    from torchtitan.config.manager import JobConfig
    from torchtitan.datasets.shard import DataShard
    from torchtitan.distributed.mesh import OuterSum, WorldMesh
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.features.documents.feed import Batch


class Tokenizer(Protocol):
    n_words: int
    eos_id: int


class Parts(Protocol):
    """The run's built parts, as a feature's builder reads them (the engine's ``CoreParts``)."""

    config: JobConfig
    rank: int
    device: torch.device
    parallel_dims: ParallelDims
    world: WorldMesh
    run_folder: str
    shard: DataShard
    tokenizer: Tokenizer
    data_loader: Iterable
    model_args: Any
    num_params: int
    num_flop_params: int
    step_fn: StepFunction
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    model_scope: ModelScope

    @property
    def model_parts(self) -> list[nn.Module]: ...

    def shard_batch(self, inputs: torch.Tensor, labels: torch.Tensor, packed: Any = None) -> Batch: ...

    def next_batches(self, data_iter: Iterator) -> list[Batch]: ...


class Metrics(Protocol):
    """What the loop and the after-step work use of ``StepMetrics``."""

    def add_data_time(self, seconds: float) -> None: ...
    def add_wait(self, seconds: float) -> None: ...
    def add_step(self, tokens: float) -> None: ...
    def log(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, *, lr: float, extra: Any) -> None: ...
    def log_validation(self, step: int, record: dict[str, float]) -> None: ...
    def log_eval(self, step: int, record: dict[str, float]) -> None: ...
    def end_summary(self, steps: int, checkpoint: str) -> str: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class StepAttempt:
    step: int
    """The step this attempt trains: the committed steps + 1 (a healed replica group jumps here)."""
    data_moved: bool
    """The loader's position was replaced (a heal): the trainer makes its data iterator again."""


class OuterSync(Protocol):
    """A step's agreement with the other replica groups, in the order the loop calls it: ``start_step``, the
    sums inside the step (``outer_sum``), ``reduce_gradients``, ``commit``, ``step_optimizer``, ``finish_step``.
    Every member is used by the engine, the checkpointer or the metrics."""

    outer_sum: OuterSum | None
    """Sums over the live groups inside a step (token counts, expert loads), or None where there are none."""
    loss_max: torch.Tensor | None
    """This rank's loss, the max over the groups, of the last step (None: the rank's own)."""

    @property
    def step(self) -> int:
        """The committed steps."""

    @property
    def can_stop(self) -> bool:
        """A stop signal may end the run after the current step."""

    @property
    def writes_checkpoints(self) -> bool:
        """This group writes the checkpoint (of several groups sharing one folder, one does)."""

    @property
    def sets_aside_later(self) -> bool:
        """A resume from an earlier checkpoint sets later ones aside (a group sharing a folder with live ones
        must not)."""

    def resume_at(self, step: int) -> None:
        """The run resumed from a checkpoint of ``step``."""

    def start_step(self) -> StepAttempt:
        """Join the step (a restarted group heals here, before its forward pass)."""

    def reduce_gradients(
        self, finish_gradients: Callable[[], list[nn.Parameter]], loss: torch.Tensor
    ) -> tuple[torch.Tensor, list[nn.Parameter] | None]:
        """After backward: (the loss to log, the parameters whose gradients were averaged across the groups, or
        None when nothing was averaged and clipping finds them itself)."""

    def commit(self, step: int) -> bool:
        """Whether step ``step`` is applied."""

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step of a committed step."""

    def finish_step(self, committed: bool) -> bool:
        """After the commit; returns whether the data position moved (the loop makes its iterator again)."""

    def data_state(self, data_loader: Any) -> Stateful:
        """What a checkpoint saves as the data position (the loader's, or every group's)."""

    def checkpoint_state(self) -> dict[str, Stateful]:
        """Parts of a full checkpoint beside the trainer's own."""

    def metrics(self, group_batch: int) -> tuple[dict[str, Any], dict[str, float]] | None:
        """The log record's fields and TensorBoard scalars (``group_batch``: samples of one group's step)."""

    def before_stop(self, step: int) -> None:
        """A stop signal ends the run after ``step``: raise ``RunStopped`` if this group must leave unsaved."""

    def add_modeled_memory(self, memory: Any, model_parts: list[nn.Module], device: torch.device) -> None:
        """The memory estimator's (estimation/tracker.py ``StepMemory``): add what the groups hold that the fake
        step does not run (modeled rows and notes)."""

    def report_end(self, step: int) -> None:
        """The run's last step is done."""

    def close(self) -> None: ...


class SingleGroup:
    """``OuterSync`` of a run without replica groups: every step commits, nothing crosses the world."""

    outer_sum: OuterSum | None = None
    loss_max: torch.Tensor | None = None
    can_stop = True
    writes_checkpoints = True
    sets_aside_later = True

    def __init__(self) -> None:
        self._step = 0

    @property
    def step(self) -> int:
        return self._step

    def resume_at(self, step: int) -> None:
        self._step = step

    def start_step(self) -> StepAttempt:
        return StepAttempt(step=self._step + 1, data_moved=False)

    def reduce_gradients(
        self, finish_gradients: Callable[[], list[nn.Parameter]], loss: torch.Tensor
    ) -> tuple[torch.Tensor, list[nn.Parameter] | None]:
        return loss, None

    def commit(self, step: int) -> bool:
        self._step = step
        return True

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def finish_step(self, committed: bool) -> bool:
        return False

    def data_state(self, data_loader: Any) -> Any:
        return data_loader

    def checkpoint_state(self) -> dict[str, Stateful]:
        return {}

    def metrics(self, group_batch: int) -> None:
        return None

    def before_stop(self, step: int) -> None:
        pass

    def add_modeled_memory(self, memory: Any, model_parts: list[nn.Module], device: torch.device) -> None:
        pass

    def report_end(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class OptimizerStep(Protocol):
    """How a step's gradients become its update."""

    def grad_norm(self, clip: Callable[[list[nn.Parameter] | None], torch.Tensor], params: list | None) -> torch.Tensor:
        """The step's total gradient norm (``clip``: the step function's clip over ``params``)."""

    def apply(self, optimizer: torch.optim.Optimizer, outer: OuterSync) -> None:
        """Apply a committed, kept step's update."""

    @property
    def steps_in_backward(self) -> bool:
        """The parameters already stepped during backward (the memory estimator counts no list-wide step)."""


class ClipAndStep:
    """The default: clip the gradients to ``training.max_norm``, then the optimizer (or the replica groups') step."""

    steps_in_backward = False

    def grad_norm(self, clip: Callable[[list[nn.Parameter] | None], torch.Tensor], params: list | None) -> torch.Tensor:
        return clip(params)

    def apply(self, optimizer: torch.optim.Optimizer, outer: OuterSync) -> None:
        outer.step_optimizer(optimizer)


class StepPass(Protocol):
    """Runs the forward/backward of a step's micro-batches: ``run(step, train_pass, *args, **kwargs) -> loss``."""

    def run(self, step: int, train_pass: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor: ...


class DirectPass:
    """The default ``StepPass``: once."""

    def run(self, step: int, train_pass: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        return train_pass(*args, **kwargs)


class AfterStep(Protocol):
    """Work after a committed step at its own schedule (it logs through the run's metrics)."""

    def maybe_run(self, step: int) -> None: ...


class NoStepHooks:
    """``spec.StepHooks`` of a family (and run) without per-step work."""

    def aux_loss(self, model_part: nn.Module, scale: float) -> torch.Tensor | None:
        return None

    def reduce_step(self, *, keep_metrics: bool, outer_sum: OuterSum | None) -> None:
        pass

    def after_optimizer_step(self) -> None:
        pass

    def discard_step(self) -> None:
        pass

    def metrics(self) -> None:
        return None


class PlanTerms:
    """What an optional feature changes in the planner's per-rank terms (estimation/plan.py; its builder: the
    registry's ``Feature.plan``) and in the start summary's lines. A feature subclasses it and overrides what it
    changes; the base is the run without one: every parameter trains, fp32, the optimizer's own state, no extra
    communication, nothing to say."""

    def summary(self, config: JobConfig, args: Any, params: int) -> str | None:
        """The start summary's line on what trains (``params``: the model's, without the feature's own), or None."""
        return None

    def trainable(self, config: JobConfig, args: Any, params: int) -> int:
        """The parameters with gradients and optimizer state, of ``params``."""
        return params

    def param_bytes(self, config: JobConfig, args: Any, params: int) -> int:
        """Bytes of the model's parameters (training.dtype's)."""
        return params * to_dtype(config.training.dtype).itemsize

    def state_bytes(self, config: JobConfig, args: Any, trainable: int) -> int | None:
        """The optimizer state's bytes; None: the optimizer's own rules over the whole model."""
        return None

    def comm_seconds(self, config: JobConfig, shard_params: float, inter_node_bytes_per_s: float) -> float:
        """Seconds per step of communication the layout's axes do not cover (``shard_params``: a rank's)."""
        return 0.0
