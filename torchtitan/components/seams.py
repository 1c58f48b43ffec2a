"""The step's seams: the declared interfaces through which optional features take part in a run, and the null
object the engine uses where a feature is off (so the loop has no ``if feature is None`` branches). The replica
groups' seams (fault tolerance) are in components/group_seams.py.

- ``ModelTransform``: a change to the model around its parallelisms (float8, LoRA, a kernel, the dtype cast);
  ``NoTransform`` is the base that changes nothing.
- ``BatchFeed``: what each batch carries to the forwards beside its tokens (block_causal's documents); off: None.
- ``OptimizerStep``: how gradients become an update (clip then step, or stepped during backward); default
  ``ClipAndStep``.
- ``StepPass``: how the forward/backward of a step's micro-batches runs (step replay runs it twice); default
  ``DirectPass``.
- ``StepRunner``: what one step of the run does (pre-training's, or reinforcement learning's generate-and-update);
  default ``engine/pretrain_step.py:PretrainStep``.
- ``AfterStep``: work after a committed step at its own schedule (validation, evaluation); off: none.
- ``NoStepHooks``: a family without per-step work (``spec.StepHooks``).
- ``PlanTerms``: what a feature changes in the memory estimate's modeled terms, ``estimation.py --plan``'s per-rank
  terms and the start summary; the base changes nothing.

And what a feature's builder writes to (``Metrics``), declared here, below the features, so a feature names no
engine type; what it reads is ``components/parts.py:CoreParts``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from torchtitan.dtypes import to_dtype

if TYPE_CHECKING:
    from collections.abc import Iterator

    from torchtitan.components.batch import Batch, Documents
    from torchtitan.components.group_seams import GradientSync
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.mesh import OuterSum


class Tokenizer(Protocol):
    n_words: int
    eos_id: int


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


class OptimizerStep(Protocol):
    """How a step's gradients become its update."""

    def grad_norm(self, clip: Callable[[list[nn.Parameter] | None], torch.Tensor], params: list | None) -> torch.Tensor:
        """The step's total gradient norm (``clip``: the step function's clip over ``params``)."""

    def apply(self, optimizer: torch.optim.Optimizer, gradients: GradientSync) -> None:
        """Apply a committed, kept step's update (``gradients``: the replica groups', which may step it)."""

    @property
    def steps_in_backward(self) -> bool:
        """The parameters already stepped during backward (the memory estimator counts no list-wide step)."""

    def stepping(self, optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
        """The optimizers whose ``step`` applies the update (the memory estimator hooks them)."""


class ClipAndStep:
    """The default: clip the gradients to ``training.max_norm``, then the optimizer (or the replica groups') step."""

    steps_in_backward = False

    def grad_norm(self, clip: Callable[[list[nn.Parameter] | None], torch.Tensor], params: list | None) -> torch.Tensor:
        return clip(params)

    def apply(self, optimizer: torch.optim.Optimizer, gradients: GradientSync) -> None:
        gradients.step_optimizer(optimizer)

    def stepping(self, optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
        return [optimizer]


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


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor
    """This rank's mean loss (with replica groups: averaged over them), unsynced."""
    grad_norm: torch.Tensor
    committed: bool
    """Whether the step was applied; False only when the replica groups discarded it."""
    stop: bool = False
    """The step's guard asks every rank to stop after it (a non-finite step under ``training.on_nonfinite``)."""


class StepRunner(Protocol):
    """What one step of the run does, as the loop drives it: its data (timed as the step's data time), then the
    training on it; the loop does the rest (the agreement's attempt and commit, metrics, after-step work, saves)."""

    def data(self, step: int, data_iter: Iterator) -> Any:
        """The step's input: pre-training's micro-batches, RL's rollouts."""

    def train(self, step: int, data: Any, *, phase_done: Callable[[str], None] | None = None) -> StepResult:
        """Train on ``data``; ``phase_done(name)``: called at the end of each phase of the step's own (RL's
        generation), for the memory estimator's tracker."""

    def step_tokens(self) -> float:
        """This rank's tokens of a step (tokens/s, MFU)."""

    def metrics(self) -> tuple[dict[str, Any], dict[str, float]] | None:
        """The step record's fields of the runner's own, and their TensorBoard scalars."""

    def summary_lines(self) -> dict[str, str]:
        """Lines of the start summary that this runner replaces or adds (by key: ``batch``, ``data``, ...)."""

    def after_commit(self, step: int, *, logged: bool) -> None:
        """After a committed step's records and saves (``logged``: the step was a log step)."""

    def close(self) -> None:
        """At the run's end, however it ends: what the runner started outside the process (RL's generator)."""


class ModelTransform:
    """A change to the model around its parallelisms: ``convert`` on the meta model (or a pipeline stage) before
    them, ``after_init`` once it is materialised and initialised from the seed. Applied in the registry's order (its
    ``model_transform`` slot); this base changes nothing, a transform overrides what it changes."""

    def convert(self, part: nn.Module) -> None:
        """Before the parallelisms, on the meta model: e.g. swap modules (float8, LoRA) or cast parameters."""

    def after_init(self, part: nn.Module, seed: int) -> None:
        """After ``to_empty`` and the seeded init of the whole part (e.g. LoRA's adapters drawn from the seed)."""


class BatchFeed(Protocol):
    """What each batch carries to the model's forwards beside its tokens (block_causal's documents)."""

    def prepare(self, inputs: torch.Tensor, labels: torch.Tensor, packed: Any = None) -> tuple[torch.Tensor, Any]:
        """The batch's labels (masked where the feed says) and its documents, before context parallel cuts it."""

    def record(self, batches: list[Batch]) -> None:
        """Add the step's batches to the statistics ``take_stats`` returns."""

    def take_stats(self) -> Any:
        """The statistics recorded since the last call (the step record's), or None."""

    def use(self, documents: Documents) -> contextlib.AbstractContextManager[None]:
        """Every forward inside sees ``documents``."""

    def plain_causal(self) -> contextlib.AbstractContextManager[None]:
        """Every forward inside runs plain causal attention (evaluation's requests)."""


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

    def modeled_memory(
        self, memory: Any, config: JobConfig, model_parts: list[nn.Module], device: torch.device
    ) -> None:
        """The memory estimate (estimation/tracker.py ``StepMemory``): add what the feature holds that the fake step
        does not run (modeled rows and notes)."""

    def comm_seconds(self, config: JobConfig, shard_params: float, inter_node_bytes_per_s: float) -> float:
        """Seconds per step of communication the layout's axes do not cover (``shard_params``: a rank's)."""
        return 0.0
