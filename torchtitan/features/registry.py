"""The one registry of the trainer's parts and optional features: each entry's pre-launch checks and, for an
optional feature, when it is on and what it builds into which slot of the run.

Core files (the engine, the build path, the preflight) do not name features: they read this table. An entry names
its check functions and its builders as ``"module:function"`` strings (``spec.Deferred``), imported only when a
check runs or a run turns the feature on, so this module imports nothing of the package but that (anything may
read the table: the build path asks it for the model transforms).

The slots and the records (``Slot``, ``Check``, ``Feature``) are in features/slots.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchtitan.features.slots import Check, Feature, Reads, Slot
from torchtitan.spec import Deferred

if TYPE_CHECKING:
    import torch

    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.spec import ModelSpec


def _d(target: str) -> Deferred:
    return Deferred(target)


def _c(target: str, reads: Reads = "config", what: str = "") -> Check:
    """A check named by ``"module:function"``, imported when it first runs."""
    return Check(Deferred(target), reads, what)


def _same(builds: Mapping[Slot, Deferred]) -> dict[str, Mapping[Slot, Deferred]]:
    """A feature whose estimator builds its slots as a run does."""
    return {"builds": builds, "estimate": builds}


def _pure_bf16(config: JobConfig) -> bool:
    return config.training.dtype != "float32"


_FT_SHARD = _d("torchtitan.features.fault_tolerance.setup:build_data_shard")
_FLOAT8 = {"model_transform": _d("torchtitan.features.float8.transform:build_float8_transform")}
_SCALE_PRECOMPUTE = {"step_hooks": _d("torchtitan.features.float8.transform:build_scale_precompute")}
_KERNEL = {"model_transform": _d("torchtitan.models.qwen3_5.kernels:build_kernel_transform")}
_LORA = {
    "model_transform": _d("torchtitan.features.lora.apply:build_lora_transform"),
    "checkpoint_scope": _d("torchtitan.features.lora.checkpoint:build_scope"),
}
_QLORA = {"after_load": _d("torchtitan.features.lora.quantize:quantize_loaded_base")}
_CAST = {"model_transform": _d("torchtitan.components.transforms:build_parameter_cast")}
_FREEZE_VISION = {"model_transform": _d("torchtitan.components.transforms:build_vision_freeze")}
_DOCUMENTS = {"batch_feed": _d("torchtitan.features.documents.feed:build_document_feed")}
_REPLAY = {"step_pass": _d("torchtitan.features.replay.replay:build_step_replay")}
_IN_BACKWARD = {"optimizer_step": _d("torchtitan.features.in_backward.in_backward:build_in_backward_step")}
_RL_MODULES = _d("torchtitan.features.rl.build:build_reference")

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
# the model against the layout, then files, then the bookkeeping keys; the order of the model transforms (float8
# first: TP picks float8 styles for converted linears, LoRA adapts the converted linears, the cast after the
# adapters exist) and of the ``after_step`` work.
FEATURES: tuple[Feature, ...] = (  # declarative table
    Feature("memory_snapshot", (_c("torchtitan.observability.profiling:check_memory_snapshot_device", "device"),)),
    Feature("activation_checkpoint", (_c("torchtitan.distributed.activation_checkpoint:check_activation_checkpoint"),)),
    Feature(
        "pure_bf16",
        (_c("torchtitan.components.checks:check_training_dtype"),),
        enabled=_pure_bf16,
        switch="training.dtype = 'bfloat16'",
    ),
    Feature("memory_options", (_c("torchtitan.components.checks:check_memory_options"),)),
    Feature("data_parallel", (_c("torchtitan.distributed.parallel_dims:check_data_parallel"),)),
    Feature("pairs", (Check(check_pairs),)),
    Feature(
        "fault_tolerance",
        (
            _c("torchtitan.features.fault_tolerance.checks:check_fault_tolerance"),
            _c(
                "torchtitan.features.fault_tolerance.checks:check_fault_tolerance_machine",
                "machine",
                "torchft installed and TORCHFT_LIGHTHOUSE set",
            ),
            _c("torchtitan.features.fault_tolerance.checks:check_fault_tolerance_device", "device"),
        ),
        enabled=lambda c: c.fault_tolerance.enable,
        switch="fault_tolerance.enable",
        builds={"data_shard": _FT_SHARD, "group_seams": _d("torchtitan.features.fault_tolerance.setup:build_replicas")},
        estimate={
            "data_shard": _FT_SHARD,
            "group_seams": _d("torchtitan.features.fault_tolerance.estimate:build_estimated_replicas"),
        },
        plan=_d("torchtitan.features.fault_tolerance.estimate:plan_terms"),
    ),
    Feature("param_groups", (_c("torchtitan.components.optim.param_groups:check_param_groups"),)),
    Feature(
        "optimizer_in_backward",
        (_c("torchtitan.features.in_backward.checks:check_in_backward"),),
        enabled=lambda c: c.optimizer.early_step_in_backward,
        switch="optimizer.early_step_in_backward",
        **_same(_IN_BACKWARD),
    ),
    Feature(
        "step_replay",
        (_c("torchtitan.features.replay.checks:check_replay"),),
        enabled=lambda c: c.training.replay_every_n_steps > 0,
        switch="training.replay_every_n_steps",
        **_same(_REPLAY),
    ),
    Feature("lr_schedule", (_c("torchtitan.components.optim.lr_schedule:check_lr_schedule"),)),
    Feature(
        "float8",
        (
            _c("torchtitan.features.float8.checks:check_float8"),
            _c("torchtitan.features.float8.checks:check_torchao_installed", "machine", "torchao installed (float8)"),
        ),
        enabled=lambda c: c.float8.enable_float8_linear,
        switch="float8.enable_float8_linear",
        **_same(_FLOAT8),
    ),
    Feature(
        "float8_scale_precompute",
        enabled=lambda c: c.float8.precompute_float8_dynamic_scale_for_fsdp,
        switch="float8.precompute_float8_dynamic_scale_for_fsdp",
        **_same(_SCALE_PRECOMPUTE),
    ),
    # The family and flavor exist; the flavor's shapes under TP and PP; the family's own check (FFN width, experts).
    Feature("model", (_c("torchtitan.spec:check_model"),)),
    Feature("mtp", (_c("torchtitan.features.mtp.checks:check_mtp"),)),  # multi-token prediction: after the model's
    # CUDA graphs of the compiled blocks: after the model check (it reads the flavor), beside its device
    Feature(
        "cuda_graphs",
        (
            _c("torchtitan.features.cuda_graphs.checks:check_cuda_graphs"),
            _c("torchtitan.features.cuda_graphs.checks:check_cuda_graphs_device", "device"),
        ),
    ),
    Feature(
        "linear_attention_kernel",  # Gated DeltaNet's kernel; a model without such layers is left alone
        enabled=lambda c: True,
        switch="model.linear_attention_kernel",
        **_same(_KERNEL),
    ),
    Feature(
        "lora",
        (
            _c("torchtitan.features.lora.checks:check_lora"),
            _c("torchtitan.features.lora.checks:check_qlora_torchao", "machine", "torchao installed (QLoRA)"),
        ),
        enabled=lambda c: c.lora.enable,
        switch="lora.enable",
        plan=_d("torchtitan.features.lora.estimate:plan_terms"),
        **_same(_LORA),
    ),
    Feature(
        "qlora",
        enabled=lambda c: c.lora.enable and c.lora.quantize_base == "nf4",
        switch="lora.quantize_base",
        **_same(_QLORA),
    ),
    Feature(
        "parameter_cast",  # pure_bf16's transform: after the adapters exist, before the parallelisms wrap them
        enabled=_pure_bf16,
        switch="training.dtype = 'bfloat16'",
        **_same(_CAST),
    ),
    Feature(
        "freeze_vision",
        enabled=lambda c: c.model.freeze_vision,
        switch="model.freeze_vision",
        **_same(_FREEZE_VISION),
    ),
    Feature(
        "dsa_stage",  # DeepSeek-V3.2's training stage, read by that family's flavor args (models/deepseek_v32/spec.py)
        (_c("torchtitan.models.deepseek_v32.spec:check_dsa_stage_key"),),
        enabled=lambda c: c.model.dsa_stage != "flavor",
        switch="model.dsa_stage",
        **_same({}),
    ),
    Feature(
        "tensor_parallel",
        (
            _c("torchtitan.distributed.tensor_parallel.checks:check_tensor_parallel"),
            _c("torchtitan.distributed.tensor_parallel.checks:check_async_tp_device", "device"),
        ),
    ),
    Feature("context_parallel", (_c("torchtitan.distributed.context_parallel.checks:check_context_parallel"),)),
    Feature(
        "documents",
        (
            _c("torchtitan.features.documents.checks:check_attention"),
            _c("torchtitan.features.documents.checks:check_attention_device", "device"),
        ),
        enabled=lambda c: c.model.attn_mask_type == "block_causal",
        switch="model.attn_mask_type = 'block_causal'",
        **_same(_DOCUMENTS),
    ),
    Feature("fine_tuning", (_c("torchtitan.datasets.sft.checks:check_fine_tuning"),)),
    Feature(
        "rl",
        (
            _c("torchtitan.features.rl.checks:check_rl"),
            _c("torchtitan.features.rl.checks:check_rl_machine", "machine", "rl.prompts_path and rl.reward"),
        ),
        enabled=lambda c: c.rl.enable,
        switch="rl.enable",
        builds={
            "data_loader": _d("torchtitan.features.rl.build:build_prompt_source"),
            "step_modules": _RL_MODULES,
            "step_runner": _d("torchtitan.features.rl.build:build_rl_step"),
        },
        estimate={
            "data_loader": _d("torchtitan.features.rl.estimate:build_no_prompts"),
            "step_modules": _RL_MODULES,
            "step_runner": _d("torchtitan.features.rl.estimate:build_estimated_rl_step"),
        },
        what="the RL loop (generation, rewards, the policy update)",
    ),
    Feature(
        "data_paths", (_c("torchtitan.datasets.checks:check_data_paths", "machine", "the tokenizer and data paths"),)
    ),
    Feature(
        "initial_load",
        (_c("torchtitan.checkpointing.checks:check_initial_load", "machine", "checkpoint.initial_load_path"),),
    ),
    # after the tokenizer file and the HF folder are found: the model's rows against the tokenizer's words
    Feature(
        "vocabulary",
        (
            _c(
                "torchtitan.checkpointing.checks:check_vocabulary",
                "machine",
                "the model's vocabulary against the tokenizer",
            ),
        ),
    ),
    Feature(
        "dump_folder", (_c("torchtitan.launch.run_folder:check_dump_folder", "machine", "job.dump_folder writable"),)
    ),
    Feature(
        "validation",
        enabled=lambda c: c.validation.enabled,
        switch="validation.enabled",
        builds={"after_step": _d("torchtitan.features.validation.validation:build_validation")},
        what="validation",
    ),
    Feature(
        "eval",
        (
            _c("torchtitan.features.in_loop_eval.checks:check_eval"),
            _c(
                "torchtitan.features.in_loop_eval.checks:check_eval_tasks",
                "machine",
                "lm-eval installed and the eval tasks",
            ),
        ),
        enabled=lambda c: c.eval.enabled,
        switch="eval.enabled",
        builds={"after_step": _d("torchtitan.features.in_loop_eval.loop:build_in_loop_eval")},
        what="the in-loop evaluation",
    ),
    Feature(
        "compile_report",
        enabled=lambda c: c.training.compile,
        switch="training.compile",
        builds={"after_step": _d("torchtitan.observability.compile_report:build_compile_report")},
        estimate={},
        what="the compile report",
    ),
    Feature("profiling", (_c("torchtitan.observability.profiling:check_profiling"),)),
    Feature("metrics", (_c("torchtitan.observability.metrics:check_metrics"),)),
    Feature(
        "checkpoint",
        (
            _c("torchtitan.checkpointing.checks:check_checkpoint"),
            _c(
                "torchtitan.checkpointing.checks:check_checkpoint_storage",
                "machine",
                "a URL checkpoint.folder writable",
            ),
        ),
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
        if slot in builds:  # an estimate's builders may leave a slot out: nothing of it is in the step
            found.append((feature, builds[slot]))
    return found


def plan_terms(config: JobConfig) -> list:
    """The planner's terms of every feature ``config`` turns on that changes them (estimation/plan.py)."""
    return [feature.plan(config) for feature in FEATURES if feature.plan is not None and feature.is_on(config)]


def build_slot(config: JobConfig, slot: Slot, default: Any, *args: Any, estimate: bool = False, **kwargs: Any) -> Any:
    """The one enabled feature's part for a one-feature ``slot``, built from ``args``, or ``default`` where none is on."""
    found = enabled_builders(config, slot, estimate=estimate)
    if not found:
        return default
    assert len(found) == 1, f"two features fill the {slot} slot: {[f.name for f, _ in found]}"
    return found[0][1](*args, **kwargs)


def model_transforms(config: JobConfig, spec: ModelSpec, device: torch.device, *, estimate: bool = False) -> tuple:
    """The model transforms of every enabled feature, in the table's order (components/seams.py ``ModelTransform``)."""
    return tuple(
        build(config, spec, device) for _, build in enabled_builders(config, "model_transform", estimate=estimate)
    )


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
