"""The one registry of the trainer's parts and optional features: each entry's pre-launch checks and, for an
optional feature, when it is on and what it builds into which seam of the step.

Core files (the engine, the preflight) do not name features: they read this table. An entry names its check
functions (light modules beside each feature: no DTensor, DCP, pipelining or data stack) and its builders as
``"module:function"`` strings (``spec.Deferred``), imported only when a run turns the feature on.

Seams (``Slot``) and the signature of a builder for each:

- ``data_shard``: ``(world: WorldMesh, config) -> DataShard``: the part of every global batch this rank reads;
  one feature at most (default: its data-parallel rank and degree).
- ``outer``: ``(core: CoreParts) -> OuterSync`` (components/seams.py); one feature at most.
- ``optimizer_step``: ``(step_fn, optimizer, optimizer_config) -> OptimizerStep``; one feature at most.
- ``after_load``: ``(core: CoreParts) -> None``, called once after the checkpoint load; every enabled one.
- ``step_pass``: ``(core: CoreParts) -> StepPass``; one feature at most.
- ``after_step``: ``(core: CoreParts, metrics) -> AfterStep``; every enabled one, in this table's order.
- ``driver``: ``(config, *, world_size, rank, builders) -> Trainer``: the loop that drives the built parts instead of
  the pre-training one (reinforcement learning's); one feature at most.
- ``checkpoint_scope``: ``(config) -> ModelScope`` (checkpointing/scope.py): the part of the model the run trains
  and its checkpoints hold; one feature at most (default: the whole model).

``estimate``: the builders the memory estimator uses for the same seams; an enabled feature with builders but
no ``estimate`` is refused by the estimator in one line (it models the training step, not that feature).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from torchtitan.checkpointing.checks import (
    check_checkpoint,
    check_checkpoint_storage,
    check_initial_load,
    check_vocabulary,
)
from torchtitan.components.checks import check_memory_options, check_training_dtype
from torchtitan.components.optim.lr_schedule import check_lr_schedule
from torchtitan.components.optim.param_groups import check_param_groups
from torchtitan.datasets.checks import check_data_paths
from torchtitan.datasets.sft.checks import check_fine_tuning
from torchtitan.distributed.activation_checkpoint import check_activation_checkpoint
from torchtitan.distributed.context_parallel.checks import check_context_parallel
from torchtitan.distributed.parallel_dims import ParallelDims, check_data_parallel
from torchtitan.distributed.tensor_parallel.checks import check_async_tp_device, check_tensor_parallel
from torchtitan.eval.checks import check_eval, check_eval_tasks
from torchtitan.fault_tolerance.checks import (
    check_fault_tolerance,
    check_fault_tolerance_device,
    check_fault_tolerance_machine,
)
from torchtitan.features.documents.checks import check_attention, check_attention_device
from torchtitan.features.float8.checks import check_float8, check_torchao_installed
from torchtitan.features.in_backward.checks import check_in_backward
from torchtitan.features.replay.checks import check_replay
from torchtitan.launch.run_folder import check_dump_folder
from torchtitan.lora.checks import check_lora, check_qlora_torchao
from torchtitan.observability.metrics import check_metrics
from torchtitan.observability.profiling import check_memory_snapshot_device, check_profiling
from torchtitan.rl.checks import check_rl, check_rl_machine
from torchtitan.spec import Deferred, check_model

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig

Slot = Literal[
    "data_shard", "outer", "optimizer_step", "after_load", "step_pass", "after_step", "checkpoint_scope", "driver"
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
    what: str = ""
    """How a message names it (default: its name)."""
    plan: Deferred | None = None
    """``(config) -> PlanTerms``: what it changes in ``estimation.py --plan``'s per-rank terms (estimation/plan.py)."""

    def is_on(self, config: JobConfig) -> bool:
        return self.enabled is not None and self.enabled(config)


def _d(target: str) -> Deferred:
    return Deferred(target)


_FT_SHARD = _d("torchtitan.fault_tolerance.setup:build_data_shard")
_LORA = {"checkpoint_scope": _d("torchtitan.lora.checkpoint:build_scope")}
_QLORA = {"after_load": _d("torchtitan.lora.quantize:quantize_loaded_base")}
_REPLAY = {"step_pass": _d("torchtitan.features.replay.replay:build_step_replay")}
_IN_BACKWARD = {"optimizer_step": _d("torchtitan.features.in_backward.in_backward:build_in_backward_step")}

# Optional features not built to run together, and why: the refusal of a pair lives here, so neither feature's
# folder names the other.
NOT_BUILT_TOGETHER: tuple[tuple[str, str, str], ...] = (
    ("lora", "fault_tolerance", "the replica groups would average and heal the frozen base, untested"),
    ("pure_bf16", "lora", "adapters over bf16 or NF4 base weights; LoRA's mixed precision already computes in bf16"),
    ("rl", "lora", "the published policy and the reference over adapters, untested"),
    ("rl", "fault_tolerance", "replica groups would each generate and score their own rollouts, untested"),
    ("rl", "step_replay", "a replayed RL step would generate its rollouts again, untested"),
    ("rl", "optimizer_in_backward", "RL's mini-batch updates clip and step after their backward"),
    ("rl", "validation", "RL records its rewards each step; validate the exported policy with bench/rl_arith.py"),
    ("rl", "eval", "RL records its rewards each step; evaluate the exported policy with lm-eval"),
)


def check_pairs(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Refuse two enabled features that ``NOT_BUILT_TOGETHER`` lists, naming both switches."""
    on = {f.name: f for f in FEATURES if f.is_on(config)}
    for one, other, why in NOT_BUILT_TOGETHER:
        if one in on and other in on:
            raise NotImplementedError(
                f"{on[one].switch} with {on[other].switch}: not built ({why}); turn one of them off"
            )
    return []


# The order is the order a config with several problems hears about them: the layout's features first, then
# the model against the layout, then files, then the bookkeeping keys; and the order of the ``after_step`` work.
FEATURES: tuple[Feature, ...] = (  # declarative table
    Feature("memory_snapshot", (Check(check_memory_snapshot_device, "device"),)),
    Feature("activation_checkpoint", (Check(check_activation_checkpoint),)),
    Feature(
        "pure_bf16",
        (Check(check_training_dtype),),
        enabled=lambda c: c.training.dtype != "float32",
        switch="training.dtype = 'bfloat16'",
    ),
    Feature("memory_options", (Check(check_memory_options),)),
    Feature("data_parallel", (Check(check_data_parallel),)),
    Feature("pairs", (Check(check_pairs),)),
    Feature(
        "fault_tolerance",
        (
            Check(check_fault_tolerance),
            Check(check_fault_tolerance_machine, "machine", "torchft installed and TORCHFT_LIGHTHOUSE set"),
            Check(check_fault_tolerance_device, "device"),
        ),
        enabled=lambda c: c.fault_tolerance.enable,
        switch="fault_tolerance.enable",
        builds={"data_shard": _FT_SHARD, "outer": _d("torchtitan.fault_tolerance.setup:build_replicas")},
        estimate={"data_shard": _FT_SHARD, "outer": _d("torchtitan.fault_tolerance.estimate:build_estimated_replicas")},
        plan=_d("torchtitan.fault_tolerance.estimate:plan_terms"),
    ),
    Feature("param_groups", (Check(check_param_groups),)),
    Feature(
        "optimizer_in_backward",
        (Check(check_in_backward),),
        enabled=lambda c: c.optimizer.early_step_in_backward,
        switch="optimizer.early_step_in_backward",
        builds=_IN_BACKWARD,
        estimate=_IN_BACKWARD,
    ),
    Feature(
        "step_replay",
        (Check(check_replay),),
        enabled=lambda c: c.training.replay_every_n_steps > 0,
        switch="training.replay_every_n_steps",
        builds=_REPLAY,
        estimate=_REPLAY,
    ),
    Feature("lr_schedule", (Check(check_lr_schedule),)),
    Feature("float8", (Check(check_float8), Check(check_torchao_installed, "machine", "torchao installed (float8)"))),
    # The family and flavor exist; the flavor's shapes under TP and PP; the family's own check (FFN width, experts).
    Feature("model", (Check(check_model),)),
    Feature(
        "lora",
        (Check(check_lora), Check(check_qlora_torchao, "machine", "torchao installed (QLoRA)")),
        enabled=lambda c: c.lora.enable,
        switch="lora.enable",
        builds=_LORA,
        estimate=_LORA,
        plan=_d("torchtitan.lora.estimate:plan_terms"),
    ),
    Feature(
        "qlora",
        enabled=lambda c: c.lora.enable and c.lora.quantize_base == "nf4",
        switch="lora.quantize_base",
        builds=_QLORA,
        estimate=_QLORA,
    ),
    Feature("tensor_parallel", (Check(check_tensor_parallel), Check(check_async_tp_device, "device"))),
    Feature("context_parallel", (Check(check_context_parallel),)),
    Feature("attention", (Check(check_attention), Check(check_attention_device, "device"))),
    Feature("fine_tuning", (Check(check_fine_tuning),)),
    Feature(
        "rl",
        (Check(check_rl), Check(check_rl_machine, "machine", "rl.prompts_path and rl.reward")),
        enabled=lambda c: c.rl.enable,
        switch="rl.enable",
        builds={"driver": _d("torchtitan.train_rl:RLTrainer")},
        estimate={"driver": _d("torchtitan.train_rl_estimate:EstimatedRLTrainer")},
        what="the RL loop (generation, rewards, the policy update)",
    ),
    Feature("data_paths", (Check(check_data_paths, "machine", "the tokenizer and data paths"),)),
    Feature("initial_load", (Check(check_initial_load, "machine", "checkpoint.initial_load_path"),)),
    # after the tokenizer file and the HF folder are found: the model's rows against the tokenizer's words
    Feature("vocabulary", (Check(check_vocabulary, "machine", "the model's vocabulary against the tokenizer"),)),
    Feature("dump_folder", (Check(check_dump_folder, "machine", "job.dump_folder writable"),)),
    Feature(
        "validation",
        enabled=lambda c: c.validation.enabled,
        switch="validation.enabled",
        builds={"after_step": _d("torchtitan.features.validation.validation:build_validation")},
        what="validation",
    ),
    Feature(
        "eval",
        (Check(check_eval), Check(check_eval_tasks, "machine", "lm-eval installed and the eval tasks")),
        enabled=lambda c: c.eval.enabled,
        switch="eval.enabled",
        builds={"after_step": _d("torchtitan.eval.loop:build_in_loop_eval")},
        what="the in-loop evaluation",
    ),
    Feature("profiling", (Check(check_profiling),)),
    Feature("metrics", (Check(check_metrics),)),
    Feature(
        "checkpoint",
        (Check(check_checkpoint), Check(check_checkpoint_storage, "machine", "a URL checkpoint.folder writable")),
    ),
)


def enabled_builders(config: JobConfig, slot: Slot, *, estimate: bool = False) -> list[tuple[Feature, Deferred]]:
    """The builders of ``slot`` of every feature ``config`` turns on, in the table's order.

    ``estimate``: the memory estimator's builders; a feature without them raises NotImplementedError naming
    its switch.
    """
    found = []
    for feature in FEATURES:
        if slot not in feature.builds or not feature.is_on(config):
            continue
        builds = feature.estimate if estimate else feature.builds
        if builds is None:
            raise NotImplementedError(unmodeled(feature))
        found.append((feature, builds[slot]))
    return found


def plan_terms(config: JobConfig) -> list:
    """The planner's terms of every feature ``config`` turns on that changes them (estimation/plan.py)."""
    return [feature.plan(config) for feature in FEATURES if feature.plan is not None and feature.is_on(config)]


def unmodeled(feature: Feature) -> str:
    """The estimator's one line for an enabled feature it does not model."""
    return (
        f"estimation.py: {feature.switch} = True is not modeled: {feature.what or feature.name} runs outside the "
        f"training step; the estimate covers the step; set {feature.switch} = False"
    )


def check_estimable_features(config: JobConfig) -> None:
    """Raise NotImplementedError for the first enabled feature the memory estimator does not model."""
    for feature in FEATURES:
        if feature.builds and feature.estimate is None and feature.is_on(config):
            raise NotImplementedError(unmodeled(feature))
