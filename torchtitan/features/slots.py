"""The registry's vocabulary (features/registry.py holds the table): the slots a feature builds into, each with its
builder's signature, and the two records of an entry, ``Check`` and ``Feature``.

Slots (``Slot``) and the signature of a builder for each:

- ``model_transform``: ``(config, spec, device) -> ModelTransform`` (components/seams.py): a change to the model
  around its parallelisms; every enabled one, applied in this table's order (float8, the linear-attention kernel,
  LoRA, the dtype cast, the vision freeze).
- ``step_hooks``: ``(config, model_parts) -> StepHooks``: per-step work beside the family's own; every enabled one.
- ``batch_feed``: ``(model_parts, *, model, eos_id, n_microbatches, cp_positions, group, shape_inference) ->
  BatchFeed``: what each batch carries to the forwards (block_causal's documents); one feature at most.
- ``data_shard``: ``(world: WorldMesh, config) -> DataShard``: the part of every global batch this rank reads;
  one feature at most (default: its data-parallel rank and degree).
- ``data_loader``: ``(config, tokenizer, shard, model_args) -> iterable``: the run's data instead of the token
  stream (RL's prompts); one feature at most.
- ``optimizer_step``: ``(step_fn, optimizer, optimizer_config) -> OptimizerStep``; one feature at most.
- ``checkpoint_scope``: ``(config) -> ModelScope`` (checkpointing/scope.py): the part of the model the run trains
  and its checkpoints hold; one feature at most (default: the whole model).
- ``group_seams``: ``(core: CoreParts) -> GroupSeams`` (components/group_seams.py): replica groups training one
  model together; one feature at most (default: one group).
- ``step_modules``: ``(core: CoreParts, *, meta_model) -> dict[str, nn.Module]``: modules the step runs besides the
  model (RL's frozen reference; ``meta_model``: the run's builder of a meta model), in the checkpoints too; one
  feature at most.
- ``after_load``: ``(core: CoreParts) -> None``, called once after the checkpoint load; every enabled one.
- ``step_pass``: ``(core: CoreParts) -> StepPass``; one feature at most.
- ``step_runner``: ``(core: CoreParts, *, modules, agreement, gradients, guard, start_step) -> StepRunner``: what one
  step does instead of pre-training's (RL's generate-and-update); one feature at most.
- ``after_step``: ``(core: CoreParts, metrics) -> AfterStep``; every enabled one, in this table's order.

``estimate``: the builders the memory estimator uses for the same slots; an enabled feature with builders but
no ``estimate`` is refused by the estimator in one line (it models the training step, not that feature).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.spec import Deferred

Slot = Literal[
    "model_transform",
    "step_hooks",
    "batch_feed",
    "data_shard",
    "data_loader",
    "optimizer_step",
    "checkpoint_scope",
    "group_seams",
    "step_modules",
    "after_load",
    "step_pass",
    "step_runner",
    "after_step",
]
Reads = Literal["config", "device", "machine"]


@dataclass(frozen=True)
class Check:
    """One pre-launch check. ``reads``: what it reads besides the config and the layout, which sets its signature
    and where it can run (preflight/checks.py ``skips``):

    - ``"config"``: nothing more; ``fn(config, dims) -> warnings``; runs everywhere.
    - ``"device"``: the kind of device the run trains on; ``fn(config, dims, device_type) -> warnings``; runs for
      this machine's kind, or for the cluster's (``--target``) from any machine; the memory estimator, which
      knows no device kind, skips it.
    - ``"machine"``: this machine's files, installed packages or environment; ``fn(config, dims) -> warnings``;
      runs only where the run trains (not under ``--target``, nor in the estimator).
    """

    fn: Callable[..., list[str]]
    reads: Reads = "config"
    what: str = ""
    """A machine check: what it checks, as the preflight's ``ok`` line names it when it did not run."""


@dataclass(frozen=True)
class Feature:
    """An entry: a part of every run (``enabled`` None) or an optional feature with its switch."""

    name: str
    checks: tuple[Check, ...] = ()
    enabled: Callable[[JobConfig], bool] | None = None
    switch: str = ""
    """The config key that turns it on (for messages)."""
    builds: Mapping[Slot, Deferred] = field(default_factory=dict)
    estimate: Mapping[Slot, Deferred] | None = None
    """The memory estimator's builders of the same slots (a slot left out: nothing of it is in the estimated step);
    None: the estimator refuses the feature in one line."""
    what: str = ""
    """How a message names it (default: its name)."""
    plan: Deferred | None = None
    """``(config) -> PlanTerms``: what it changes in ``estimation.py --plan``'s per-rank terms (estimation/plan.py)."""

    def is_on(self, config: JobConfig) -> bool:
        return self.enabled is not None and self.enabled(config)
