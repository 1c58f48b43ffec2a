"""torchtitan's 2025 config schema, read as this one's.

Every key of upstream's ``torchtitan/config/job_config.py`` (commit 7e4ab8599, Dec 2025) is either spelled
as here (``SHARED``) or has a rule in ``RULES`` (config/compat/spellings.py says what each kind does). The TOML
file and the command line are translated as they are read; what needs other keys or the world size is
settled once every source is in (``resolve``). docs/compatibility.md has the same table in prose.

A TOML file written in the 2025 schema (it uses a key only that schema has, and none only this one has)
also gets that schema's defaults for the keys it leaves out, where they differ from ours (``DEFAULTS``):
the run is the one upstream would make. Command-line flags never change which defaults apply.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Literal

from torchtitan.config.compat.spellings import Alias, Deferred, Fixed, Inert, Rule
from torchtitan.config.errors import ConfigError
from torchtitan.config.schema import NEGATED_ALIASES, JobConfigTree
from torchtitan.config.values import toml_value

logger = logging.getLogger(__name__)

_FLOAT8 = ("float8", "quantize.linear.float8")  # 2025 names the converter by its section; mid-2025 "float8"
_REFUSED_CONVERTERS = {
    "quantize.grouped_mm.float8": "float8 grouped GEMMs of MoE experts",
    "quantize.linear.mx": "MX-format linears",
    "quantize.grouped_mm.mx": "MX-format grouped GEMMs",
    "mx": "MX-format linears",
}


def _converters(names: list[str]) -> bool:
    """``model.converters`` -> ``float8.enable_float8_linear``."""
    for name in names:
        if name in _REFUSED_CONVERTERS:
            raise NotImplementedError(
                f"model.converters = {toml_value(names)}: {name!r} ({_REFUSED_CONVERTERS[name]}) is not built; "
                f"the converter here is 'float8' (= 'quantize.linear.float8', float8.enable_float8_linear)"
            )
        if name not in _FLOAT8:
            raise ConfigError(
                f"model.converters = {toml_value(names)}: unknown converter {name!r}; allowed: "
                f"'quantize.linear.float8' (or 'float8')"
            )
    return bool(names)


def _implementation(name: str) -> bool:
    """``optimizer.implementation`` -> ``optimizer.fused``."""
    if name == "for-loop":
        raise NotImplementedError(
            "optimizer.implementation = 'for-loop' is not built: the optimizer runs 'foreach' (multi-tensor) or "
            "'fused' (CUDA or CPU); set one of them"
        )
    return name == "fused"


def _inert(tp: object, default: object, converter: str) -> Inert:
    return Inert(tp, default, converter, f"{_REFUSED_CONVERTERS[converter]} are not built")


_LAYER = re.compile(r"layers\.(\d+)")


def _split_points(parts: Any) -> list[str]:
    """``parallelism.module_fqns_per_model_part`` -> ``experimental.pipeline_parallel_split_points``: exact
    when the parts are runs of consecutive layers, ``tok_embeddings`` first and ``norm``, ``output`` last."""
    key = "parallelism.module_fqns_per_model_part"
    if parts is None:
        return []
    if not isinstance(parts, list) or not all(
        isinstance(p, list) and all(isinstance(n, str) for n in p) for p in parts
    ):
        raise ConfigError(f"{key}: got {parts!r}, expected a list of lists of module names (give it in the TOML)")
    points, next_layer = [], 0
    for i, part in enumerate(parts):
        head = ["tok_embeddings"] if i == 0 else []
        tail = ["norm", "output"] if i == len(parts) - 1 else []
        names = part[len(head) : len(part) - len(tail)]
        layers = [int(m.group(1)) if (m := _LAYER.fullmatch(n)) else -1 for n in names]
        ends_ok = part[: len(head)] == head and (not tail or part[-len(tail) :] == tail)
        if not ends_ok or not layers or layers != list(range(next_layer, next_layer + len(layers))):
            raise ConfigError(
                f"{key}: part {i} = {part} is not the next run of layers (from layers.{next_layer}); only parts of "
                f"consecutive layers, 'tok_embeddings' first and 'norm', 'output' last, map onto "
                f"experimental.pipeline_parallel_split_points (give those instead)"
            )
        points += [f"layers.{next_layer}"] if i else []
        next_layer += len(layers)
    return points


_WSD = (("training.lr_schedule", "wsd"),)  # a [lr_scheduler] key means upstream's (only) schedule
_ESTIMATION = (
    "memory is estimated by estimation.py (python estimation.py --job.config_file ...), always on fake tensors"
)
_LOADER = "the data loader reads in the training process (num_workers = 0), so its checkpointed state is exact"
# upstream's fault-tolerance module: it adds the [fault_tolerance] keys of its torchft experiment, which are keys here
FT_CONFIG_MODULE = "torchtitan.components.ft.config"
# Upstream's qwen3 family also holds the Qwen3-MoE flavors: in a 2025 file, (qwen3, flavor) -> (qwen3_moe, this).
# The published sizes keep their names; the debug one is our qwen3_moe debug size, as every family's debug flavor
# here is ours (upstream's debugmodel_moe, 64 experts of width 768, would be a 0.3B "debug" model).
QWEN3_MOE_FLAVORS = {"debugmodel_moe": "debugmodel", "30B-A3B": "30B-A3B", "235B-A22B": "235B-A22B"}
_NCCL_DUMP = (
    "NCCL's flight-recorder dumps go where TORCH_NCCL_DEBUG_INFO_TEMP_FILE says (the trainer does not set it); "
    "remove the key and set that variable"
)

# A section kept in its feature's folder declares its own 2025 spellings: SHARED_2025 (keys spelled and meant as
# here) and RULES_2025 (keys with a rule), relative to the section.
_SECTIONS = [(f.name, f.default_factory) for f in dataclasses.fields(JobConfigTree)]

RULES: dict[str, Rule] = {
    "job.print_config": Alias("job.print_args"),
    "job.save_config_file": Fixed(
        str | None, None, "the resolved config is always written to <dump_folder>/config.toml"
    ),
    "job.custom_config_module": Fixed(
        str,
        "",
        "the config is one typed tree (upstream's torchft module's keys are keys of its section here); a new key "
        "is a field in config/schema.py",
        also=(FT_CONFIG_MODULE,),
    ),
    "metrics.save_for_all_ranks": Alias(
        "metrics.rank_0_only", convert=lambda v: not v, tp=bool, note="= not rank_0_only"
    ),
    "model.hf_assets_path": Alias(
        "model.tokenizer_path",
        note="the tokenizer folder (tokenizer.json, tokenizer_config.json); with checkpoint.initial_load_in_hf and no "
        "initial_load_path, also the weights' folder",
    ),
    "model.converters": Alias(
        "float8.enable_float8_linear",
        convert=_converters,
        tp=list[str],
        note="['quantize.linear.float8'] or ['float8'] = float8.enable_float8_linear; MX and grouped-GEMM converters "
        "refused",
    ),
    "model.print_after_conversion": Fixed(bool, False, "printing the converted model is not built"),
    "optimizer.implementation": Alias(
        "optimizer.fused",
        convert=_implementation,
        tp=Literal["for-loop", "foreach", "fused"],
        note="'fused' = fused true, 'foreach' = false (our default); 'for-loop' refused",
    ),
    "lr_scheduler.warmup_steps": Alias("training.warmup_steps", implies=_WSD, note="+ training.lr_schedule = 'wsd'"),
    "lr_scheduler.decay_ratio": Alias("training.lr_decay_ratio", implies=_WSD, note="+ training.lr_schedule = 'wsd'"),
    "lr_scheduler.decay_type": Alias("training.lr_decay_type", implies=_WSD, note="+ training.lr_schedule = 'wsd'"),
    "lr_scheduler.min_lr_factor": Alias("training.lr_min_factor", implies=_WSD, note="+ training.lr_schedule = 'wsd'"),
    "training.local_batch_size": Alias("training.batch_size"),
    "training.global_batch_size": Deferred(
        int, -1, "sets training.gradient_accumulation_steps = global / (local_batch_size x data-parallel degree)"
    ),
    "training.gc_debug": Fixed(bool, False, "the per-step gc debugging mode is not built"),
    "training.dataloader.num_workers": Fixed(int, 0, _LOADER),
    "training.dataloader.persistent_workers": Fixed(bool, False, _LOADER),
    "training.dataloader.pin_memory": Fixed(bool, False, _LOADER),
    "training.dataloader.prefetch_factor": Fixed(int | None, None, _LOADER),
    "parallelism.data_parallel_replicate_degree": Alias("training.data_parallel_replicate_degree"),
    "parallelism.data_parallel_shard_degree": Alias("training.data_parallel_shard_degree"),
    "parallelism.fsdp_reshard_after_forward": Alias("training.fsdp_reshard_after_forward"),
    "parallelism.tensor_parallel_degree": Alias("training.tensor_parallel_degree"),
    "parallelism.disable_loss_parallel": Alias(
        "training.enable_loss_parallel", convert=lambda v: not v, tp=bool, note="= not training.enable_loss_parallel"
    ),
    "parallelism.enable_async_tensor_parallel": Alias("experimental.enable_async_tensor_parallel"),
    "parallelism.pipeline_parallel_degree": Alias("experimental.pipeline_parallel_degree"),
    "parallelism.module_fqns_per_model_part": Alias(
        "experimental.pipeline_parallel_split_points",
        convert=_split_points,
        tp="raw",
        note="parts of consecutive layers -> the split points (each part's first layer); other parts refused",
    ),
    "parallelism.pipeline_parallel_first_stage_less_layers": Deferred(
        int, 1, "with pipeline parallel and no split points: only 0 (our even split); upstream's default 1 refused"
    ),
    "parallelism.pipeline_parallel_last_stage_less_layers": Deferred(
        int, 1, "with pipeline parallel and no split points: only 0 (our even split); upstream's default 1 refused"
    ),
    "parallelism.pipeline_parallel_layers_per_stage": Fixed(
        int | None,
        None,
        "stages sized by a layer count are not built; give experimental.pipeline_parallel_split_points",
    ),
    "parallelism.pipeline_parallel_schedule": Alias("experimental.pipeline_parallel_schedule"),
    "parallelism.pipeline_parallel_schedule_csv": Alias(
        "experimental.pipeline_parallel_schedule_csv", convert=lambda v: v or "", tp=str | None
    ),
    "parallelism.pipeline_parallel_microbatch_size": Deferred(
        int, 1, "with pipeline parallel: experimental.pipeline_parallel_microbatches = local_batch_size / it"
    ),
    "parallelism.pipeline_parallel_expert_parallel_overlap": Deferred(
        bool, True, "true refused where it would act (DualPipeV, pipeline and expert parallel): not built"
    ),
    "parallelism.context_parallel_degree": Alias("experimental.context_parallel_degree"),
    "parallelism.context_parallel_rotate_method": Alias("experimental.context_parallel_rotate_method"),
    "parallelism.expert_parallel_degree": Alias("experimental.expert_parallel_degree"),
    "parallelism.expert_tensor_parallel_degree": Fixed(
        int,
        1,
        "experts here are split by expert parallel over the TP ranks too (upstream's etp = 1); etp = tp is not built",
    ),
    "parallelism.expert_parallel_comm_backend": Fixed(
        Literal["standard", "deepep"], "standard", "DeepEP kernels are not built; the all-to-all is torch's"
    ),
    "checkpoint.enable": Alias("checkpoint.enable_checkpoint"),
    "checkpoint.enable_ft_dataloader_checkpoints": Fixed(
        bool,
        True,
        "every replica group's data position is always kept: exchanged between the groups each step and saved in "
        "the shared checkpoint, so no group trains a window twice",
    ),
    "checkpoint.initial_load_model_only": Fixed(
        bool, True, "initial_load_path loads the model weights only; to resume, put the checkpoint in checkpoint.folder"
    ),
    "checkpoint.initial_load_in_hf_quantized": Fixed(
        bool, False, "loading quantized Hugging Face weights is not built"
    ),
    "checkpoint.last_save_model_only": Alias("checkpoint.model_weights_only"),
    "checkpoint.enable_first_step_checkpoint": Fixed(bool, False, "a checkpoint after the first step is not built"),
    "checkpoint.load_only": Fixed(bool, False, "loading without ever saving is not built"),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": Fixed(
        list[str], [], "op-level AC here saves every other matmul, with no shapes forced to recompute"
    ),
    "activation_checkpoint.early_stop": Fixed(bool, False, "early-stopped recomputation is not built"),
    "activation_checkpoint.visualize_memory_budget_pareto": Fixed(
        bool, False, "the partitioner's memory/runtime Pareto plot is not built"
    ),
    "activation_checkpoint.preserve_rng_state": Fixed(bool, False, "AC here does not stash RNG states (no dropout)"),
    "activation_checkpoint.determinism_check": Fixed(str, "default", "AC here runs torch's default check"),
    "activation_checkpoint.debug": Fixed(bool, False, "AC debug capture is not built"),
    "compile.enable": Alias("training.compile", note="= training.compile (each transformer block); see components"),
    "compile.components": Deferred(
        list[str],
        ["model", "loss"],
        "with compile on: 'model' = training.compile (each transformer block), 'loss' = training.compile_loss",
    ),
    "compile.backend": Fixed(str, "inductor", "compile uses torch.compile's default backend, inductor"),
    "quantize.linear.float8.enable_fsdp_float8_all_gather": Alias("float8.enable_fsdp_float8_all_gather"),
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": Alias(
        "float8.precompute_float8_dynamic_scale_for_fsdp"
    ),
    "quantize.linear.float8.recipe_name": Alias(
        "float8.recipe_name", convert=lambda v: v or "tensorwise", tp=str | None, note="unset = 'tensorwise'"
    ),
    "quantize.linear.float8.filter_fqns": Alias("float8.filter_fqns"),
    "quantize.linear.float8.emulate": Fixed(bool, False, "emulated float8 GEMMs are not built"),
    # Upstream reads these only when model.converters names their converter, which is refused here.
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": _inert(str, "triton", "quantize.linear.mx"),
    "quantize.linear.mx.recipe_name": _inert(str, "mxfp8_cublas", "quantize.linear.mx"),
    "quantize.linear.mx.filter_fqns": _inert(list[str], ["output"], "quantize.linear.mx"),
    "quantize.grouped_mm.float8.fqns": _inert(list[str], [], "quantize.grouped_mm.float8"),
    "quantize.grouped_mm.mx.recipe_name": _inert(str, "mxfp8", "quantize.grouped_mm.mx"),
    "quantize.grouped_mm.mx.fqns": _inert(list[str], [], "quantize.grouped_mm.mx"),
    "comm.save_traces_folder": Fixed(str | None, None, _NCCL_DUMP),
    "comm.save_traces_file_prefix": Fixed(str | None, None, _NCCL_DUMP),
    "comm.mode": Fixed(
        Literal["default", "fake_backend", "local_tensor"],
        "default",
        "dry runs are python -m torchtitan.preflight (the config) and estimation.py (memory, on fake tensors)",
    ),
    "memory_estimation.enable": Fixed(bool, False, _ESTIMATION),
    "memory_estimation.disable_fake_mode": Fixed(bool, False, _ESTIMATION + "; its accuracy tests run real tensors"),
    "experimental.custom_import": Fixed(
        str, "", "importing modules from the config is not supported; add a model family with register_model_family"
    ),
    "experimental.custom_args_module": Fixed(
        str, "", "the config is one typed tree; a new key is a field in schema.py"
    ),
    "validation.enable": Alias("validation.enabled"),
    "validation.local_batch_size": Alias("validation.batch_size"),
    "validation.seq_len": Deferred(
        int, 2048, "with validation on: must equal training.seq_len (validation runs at it)"
    ),
    "validation.dataloader.num_workers": Fixed(int, 0, _LOADER),
    "validation.dataloader.persistent_workers": Fixed(bool, False, _LOADER),
    "validation.dataloader.pin_memory": Fixed(bool, False, _LOADER),
    "validation.dataloader.prefetch_factor": Fixed(int | None, None, _LOADER),
    "debug.seed": Alias("training.seed"),
    "debug.deterministic": Alias("training.deterministic"),
    "debug.deterministic_warn_only": Fixed(bool, False, "deterministic mode here raises on a nondeterministic op"),
    "debug.moe_force_load_balance": Fixed(bool, False, "forced round-robin routing is not built"),
}

RULES.update(
    {f"{section}.{key}": rule for section, cls in _SECTIONS for key, rule in getattr(cls, "RULES_2025", {}).items()}
)

# Keys the 2025 schema spells and means as this one does.
SHARED: frozenset[str] = frozenset(
    ["job.config_file", "job.dump_folder", "job.description", "metrics.disable_color_printing"]
    + [f"profiling.{k}" for k in ("enable_profiling", "save_traces_folder", "profile_freq")]
    + [f"profiling.{k}" for k in ("enable_memory_snapshot", "save_memory_snapshot_folder")]
    + ["profiling.profiler_active", "profiling.profiler_warmup"]
    + [f"metrics.{k}" for k in ("log_freq", "enable_tensorboard", "save_tb_folder", "enable_wandb")]
    + ["model.name", "model.flavor", "model.tokenizer_path"]
    + [f"optimizer.{k}" for k in ("name", "lr", "beta1", "beta2", "eps", "weight_decay", "early_step_in_backward")]
    + [f"training.{k}" for k in ("dataset", "dataset_path", "seq_len", "max_norm", "steps", "enable_cpu_offload")]
    + [f"training.{k}" for k in ("dtype", "mixed_precision_param", "mixed_precision_reduce", "gc_freq")]
    + [f"checkpoint.{k}" for k in ("folder", "interval", "initial_load_path", "initial_load_in_hf", "last_save_in_hf")]
    + [f"checkpoint.{k}" for k in ("export_dtype", "async_mode", "keep_latest_k", "load_step", "exclude_from_loading")]
    + ["checkpoint.create_seed_checkpoint"]
    + [f"activation_checkpoint.{k}" for k in ("mode", "selective_ac_option", "memory_budget")]
    + [f"comm.{k}" for k in ("init_timeout_seconds", "train_timeout_seconds", "trace_buf_size")]
    + [f"validation.{k}" for k in ("dataset", "dataset_path", "freq", "steps")]
    + [f"{section}.{key}" for section, cls in _SECTIONS for key in getattr(cls, "SHARED_2025", ())]
)
# Also in the late-2024 schema: they do not make a file a 2025 one.
LATE_2024 = frozenset({"memory_estimation.disable_fake_mode"})

# Upstream's defaults where ours differ, for a file in the 2025 schema: (key here, value, only when this key is true).
DEFAULTS: tuple[tuple[str, Any, str | None], ...] = (
    ("training.lr_schedule", "wsd", None),
    ("training.dataset", "c4_test", None),
    ("model.tokenizer_path", "./tests/assets/tokenizer", None),  # hf_assets_path
    ("profiling.profiler_warmup", 3, "profiling.enable_profiling"),
    ("checkpoint.model_weights_only", True, "checkpoint.enable_checkpoint"),  # last_save_model_only
    ("checkpoint.keep_latest_k", 10, "checkpoint.enable_checkpoint"),
    ("validation.batch_size", 8, "validation.enabled"),  # local_batch_size
    ("validation.dataset", "c4_validation", "validation.enabled"),
)


# Sections only the 2025 schema has: an unknown key there is matched against the 2025 keys too.
SECTIONS_2025 = frozenset({"lr_scheduler", "parallelism", "compile", "quantize", "debug"})


def _canonical_keys() -> set[str]:
    tree = JobConfigTree()
    return {f"{s.name}.{k.name}" for s in dataclasses.fields(tree) for k in dataclasses.fields(getattr(tree, s.name))}


def ours_only_keys() -> set[str]:
    """Keys a 2025 file cannot hold: this schema's own (and its late-2024 aliases)."""
    return (_canonical_keys() | set(NEGATED_ALIASES)) - SHARED


def file_is_2025(keys: list[str]) -> bool:
    ours = ours_only_keys()
    return any(k in RULES and k not in LATE_2024 for k in keys) and not any(k in ours for k in keys)
