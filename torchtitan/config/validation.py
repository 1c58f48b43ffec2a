"""Whole-config checks that run once, before any process group exists.

Every error names the key, the value, what is allowed and how to fix it. A key whose feature is
not built yet raises NotImplementedError naming the key rather than being silently ignored.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from typing import TYPE_CHECKING

import torch

from torchtitan.components.float8 import TORCHAO_PIN, check_float8_config
from torchtitan.components.optimizer_in_backward import check_in_backward_config
from torchtitan.config.attention_checks import check_attention_config
from torchtitan.config.errors import ConfigError
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_layout import resolve_stage_layout, validate_microbatches
from torchtitan.launch.run_folder import folder_problem
from torchtitan.models.llama.model import NORM_TYPES
from torchtitan.spec import get_model_spec

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig  # manager imports this module; the type is all we need

# key -> (value that means "off", what to say). Non-default values raise NotImplementedError.
_NOT_BUILT = {
    "experimental.enable_compiled_autograd": (False, "compiled autograd"),
    "memory_estimation.enabled": (False, "memory estimation in the trainer"),
}

_POSITIVE = (
    "training.steps",
    "training.batch_size",
    "training.seq_len",
    "training.gradient_accumulation_steps",
    "training.gc_freq",
    "training.max_nonfinite_skips",
    "training.data_parallel_replicate_degree",
    "training.fsdp_prefetch_depth",
    "metrics.log_freq",
    "profiling.profile_freq",
    "validation.freq",
    "validation.steps",
    "comm.init_timeout_seconds",
    "comm.train_timeout_seconds",
)


def _get(config: JobConfig, key: str):
    section, _, name = key.partition(".")
    return getattr(getattr(config, section), name)


def _check_not_built(config: JobConfig) -> None:
    for key, (off, feature) in _NOT_BUILT.items():
        if _get(config, key) != off:
            raise NotImplementedError(
                f"{key} = {_get(config, key)!r}: {feature} is not available yet; set {key} = {off!r}"
            )


def _check_finite(config: JobConfig) -> None:
    """No NaN or infinity in any float key (``--optimizer.lr inf`` would pass every range check)."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        if not dataclasses.is_dataclass(values):
            continue
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{f.name} must be a finite number, got {value}")


def _check_ranges(config: JobConfig) -> None:
    _check_finite(config)
    for key in _POSITIVE:
        if _get(config, key) < 1:
            raise ConfigError(f"{key} must be >= 1, got {_get(config, key)}")
    if config.training.warmup_steps < 0:
        raise ConfigError(f"training.warmup_steps must be >= 0, got {config.training.warmup_steps}")
    if not config.optimizer.lr > 0:
        raise ConfigError(f"optimizer.lr must be > 0, got {config.optimizer.lr}")
    if config.training.max_norm < 0:
        raise ConfigError(f"training.max_norm must be >= 0 (0 turns clipping off), got {config.training.max_norm}")
    ac = config.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        if not ac.selective_ac_option.isdigit() or int(ac.selective_ac_option) < 1:
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option = {ac.selective_ac_option!r}: "
                "allowed are 'op' or a positive integer N (checkpoint every N-th block)"
            )


def _check_model(config: JobConfig) -> None:
    try:
        spec = get_model_spec(config.model.name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    flavors = spec.flavors
    args = flavors.get(config.model.flavor)
    if args is None:
        raise ConfigError(
            f"model.flavor = {config.model.flavor!r} is not a {config.model.name} flavor; allowed are {list(flavors)}"
        )
    if config.model.norm_type not in NORM_TYPES:
        raise ConfigError(f"model.norm_type = {config.model.norm_type!r}: allowed are {list(NORM_TYPES)}")
    _check_tp_divisibility(config, args)
    _check_context_parallel(config)
    _check_pipeline(config, args)
    if spec.validate_fn is not None:
        spec.validate_fn(config, args)  # the family's own checks (FFN width under TP, experts)
    if config.training.seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len = {config.training.seq_len} does not fit model {config.model.flavor}, whose "
            f"max_seq_len is {args.max_seq_len}; lower training.seq_len"
        )


def _check_tp_divisibility(config: JobConfig, args) -> None:
    """TP shards heads and kv heads (the family checks its FFN width); sequence parallel shards the sequence."""
    tp = config.training.tensor_parallel_degree
    if tp == 1:
        if config.experimental.enable_async_tensor_parallel:
            raise ConfigError(
                "experimental.enable_async_tensor_parallel = true needs training.tensor_parallel_degree > 1"
            )
        return
    sizes = {
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads or args.n_heads,
        "training.seq_len (sequence parallel)": config.training.seq_len,
    }
    for name, size in sizes.items():
        if size % tp:
            raise ConfigError(
                f"model {config.model.flavor}: {name} = {size} is not divisible by "
                f"training.tensor_parallel_degree = {tp}; choose a TP degree that divides it"
            )
    if config.experimental.enable_async_tensor_parallel and config.experimental.async_tensor_parallel_impl == "ring":
        if config.training.compile:
            raise NotImplementedError(
                "experimental.async_tensor_parallel_impl = 'ring' with training.compile = true: the ring is "
                "eager point-to-point code that full-graph compile cannot trace; turn one of them off"
            )
    if (
        config.experimental.enable_async_tensor_parallel
        and config.experimental.async_tensor_parallel_impl == "compiler"
    ):
        if not config.training.compile:
            raise ConfigError(
                "experimental.async_tensor_parallel_impl = 'compiler' needs training.compile = true "
                "(the overlap is a compiler pass); set it, or use 'ring'"
            )


def _check_context_parallel(config: JobConfig) -> None:
    """CP splits each sequence into cp (or 2 x cp, load-balanced) equal chunks."""
    exp = config.experimental
    cp = exp.context_parallel_degree
    if cp < 1:
        raise ConfigError(f"experimental.context_parallel_degree must be >= 1, got {cp}")
    if cp == 1:
        return
    chunks = 2 * cp if exp.context_parallel_load_balance else cp
    how = (
        "2 x context_parallel_degree (load balancing)"
        if exp.context_parallel_load_balance
        else "context_parallel_degree"
    )
    if config.training.seq_len % chunks:
        raise ConfigError(
            f"training.seq_len = {config.training.seq_len} is not divisible by {how} = {chunks}; "
            f"choose a seq_len that is a multiple of {chunks}"
        )
    tp = config.training.tensor_parallel_degree
    if tp > 1 and (config.training.seq_len // cp) % tp:
        raise ConfigError(
            f"training.seq_len / context_parallel_degree = {config.training.seq_len // cp} is not divisible by "
            f"training.tensor_parallel_degree = {tp} (sequence parallel splits each CP chunk again); "
            f"choose a seq_len that is a multiple of {cp * tp}"
        )
    if exp.context_parallel_impl == "torch":
        # Imported only when asked for: that module rests on private torch names (pinned to one torch).
        from torchtitan.distributed.torch_context_parallel import check_supported

        check_supported()
    if config.training.compile:
        raise NotImplementedError(
            "experimental.context_parallel_degree > 1 with training.compile = true: ring attention is eager "
            "point-to-point code that full-graph compile cannot trace; turn one of them off"
        )


def _check_pipeline(config: JobConfig, args) -> None:
    """Stage split and micro-batches, checked here so the user sees our message, not torch's."""
    exp = config.experimental
    pp = exp.pipeline_parallel_degree
    if pp == 1:
        return
    if getattr(args, "tie_word_embeddings", False):
        raise NotImplementedError(
            f"model.flavor = {config.model.flavor!r} ties the output head to the embedding table, and "
            f"experimental.pipeline_parallel_degree = {pp} puts them on different stages (the first and the "
            "last), where one parameter cannot get both gradients; use pipeline_parallel_degree = 1 with this "
            "flavor"
        )
    if exp.pipeline_parallel_schedule_csv and not os.path.isfile(exp.pipeline_parallel_schedule_csv):
        raise FileNotFoundError(
            f"experimental.pipeline_parallel_schedule_csv = '{exp.pipeline_parallel_schedule_csv}' does not exist"
        )
    stages = resolve_stage_layout(
        args.n_layers,
        pp,
        exp.pipeline_parallel_schedule,
        exp.pipeline_parallel_split_points,
        exp.pipeline_parallel_schedule_csv,
    )
    n_microbatches = exp.pipeline_parallel_microbatches or pp
    validate_microbatches(exp.pipeline_parallel_schedule, n_microbatches, config.training.batch_size, len(stages), pp)


def _check_memory_options(config: JobConfig) -> None:
    """bf16 optimizer states and the chunked loss (see docs/parallelisms.md, "Memory-saving options")."""
    opt = config.optimizer
    if opt.state_dtype == "bfloat16" and opt.fused:
        raise ConfigError(
            "optimizer.fused = true with optimizer.state_dtype = 'bfloat16': torch's fused Adam kernel keeps its "
            "states in the parameter dtype; allowed with bfloat16 states is fused = false (the per-parameter "
            "fp32-math implementation), or set state_dtype = 'float32' to keep fused"
        )
    chunk = config.training.loss_chunk_size
    if chunk < 0:
        raise ConfigError(f"training.loss_chunk_size must be >= 0 (0 = one chunk, the full logits), got {chunk}")
    if chunk > 0 and config.experimental.pipeline_parallel_degree > 1:
        raise NotImplementedError(
            f"training.loss_chunk_size = {chunk} with experimental.pipeline_parallel_degree = "
            f"{config.experimental.pipeline_parallel_degree}: the pipeline schedule computes the loss from the "
            "last stage's logits; set training.loss_chunk_size = 0 under pipeline parallel"
        )


def _check_paths(config: JobConfig) -> None:
    from torchtitan.checkpointing.hf_run import check_initial_load

    path = config.model.tokenizer_path
    # a file, or a folder holding tokenizer.json (build_tokenizer's rule; not imported: no data stack here)
    if not os.path.isfile(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        problem = "is a folder without tokenizer.json" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(
            f"model.tokenizer_path = '{path}' {problem}; use the shipped "
            "./torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken or fetch Llama 3's (tokenizer.model) "
            "or Qwen3's (tokenizer.json) with scripts/download_tokenizer.py"
        )
    data = config.training.dataset_path
    # A hub id looks like "org/name"; anything that starts like a filesystem path must exist.
    if data is not None and data.startswith((".", "/", "~")) and not os.path.exists(os.path.expanduser(data)):
        raise FileNotFoundError(f"training.dataset_path = '{data}' does not exist")
    check_initial_load(config)
    problem = folder_problem(config.job.dump_folder)
    if problem is not None:
        raise ConfigError(f"job.dump_folder = '{config.job.dump_folder}' cannot be written: {problem}")


def _warnings(config: JobConfig, world_size: int) -> list[str]:
    out = []
    if not config.training.enable_loss_parallel and config.training.tensor_parallel_degree == 1:
        out.append("training.enable_loss_parallel = false has no effect without tensor parallel")
    t = config.training
    fsdp_knobs = t.enable_cpu_offload or t.fsdp_reshard_after_forward != "default" or t.fsdp_prefetch_depth != 1
    if fsdp_knobs and not ParallelDims.from_config(config, world_size).fsdp_enabled:
        out.append(
            "training.enable_cpu_offload / fsdp_reshard_after_forward / fsdp_prefetch_depth have no effect "
            "without FSDP (data_parallel_shard_degree > 1)"
        )
    ck = config.checkpoint
    if (
        not ck.enable_checkpoint
        and not ck.create_seed_checkpoint
        and (
            ck.async_mode != "disabled"
            or ck.keep_latest_k
            or ck.load_step != -1
            or ck.model_weights_only
            or ck.exclude_from_loading
        )
    ):
        out.append(
            "checkpoint.async_mode / keep_latest_k / load_step / model_weights_only / exclude_from_loading have no "
            "effect without checkpoint.enable_checkpoint = true"
        )
    if ck.export_dtype != "float32" and not ck.model_weights_only:
        out.append("checkpoint.export_dtype has no effect without checkpoint.model_weights_only = true")
    if config.metrics.rank_0_only is False:
        out.append("metrics.rank_0_only = false has no effect: only the logging rank writes metrics")
    return out


def _check_validation_and_logging(config: JobConfig) -> None:
    v = config.validation
    if v.batch_size is not None and v.batch_size < 1:
        raise ConfigError(f"validation.batch_size must be >= 1 (or unset), got {v.batch_size}")
    if v.enabled and v.dataset_path is not None and v.dataset_path.startswith((".", "/", "~")):
        if not os.path.exists(os.path.expanduser(v.dataset_path)):
            raise FileNotFoundError(f"validation.dataset_path = '{v.dataset_path}' does not exist")
    p = config.profiling
    if p.enable_profiling and p.profile_freq < 2:  # observability/profiling.py: 1 warmup + 1 recorded step
        raise ConfigError(
            f"profiling.profile_freq = {p.profile_freq} with profiling.enable_profiling = true: each trace needs a "
            "warmup step before the recorded one; set profile_freq >= 2"
        )
    if config.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.enable_wandb = true but the wandb package is not installed; `pip install wandb`")


def _check_checkpoint(config: JobConfig, world_size: int) -> None:
    """Checkpoint ranges and combinations (see docs/checkpoint.md)."""
    ck = config.checkpoint
    if ck.interval < 1:
        raise ConfigError(f"checkpoint.interval must be >= 1 ({ck.interval_type}), got {ck.interval}")
    if ck.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k must be >= 0 (0 keeps every checkpoint), got {ck.keep_latest_k}")
    if ck.load_step < -1:
        raise ConfigError(
            f"checkpoint.load_step must be -1 (the newest complete checkpoint) or a step >= 0, got {ck.load_step}"
        )
    excludable = ("optimizer", "lr_scheduler", "dataloader")
    for part in ck.exclude_from_loading:
        if part not in excludable:
            raise ConfigError(
                f"checkpoint.exclude_from_loading = {ck.exclude_from_loading}: {part!r} cannot be excluded; allowed "
                f"are {list(excludable)} (the model weights are what a resume loads; the step and RNG follow them)"
            )
    from torchtitan.checkpointing.hf_run import check_hf_keys

    check_hf_keys(config)
    if ck.create_seed_checkpoint and world_size != 1:
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint = true needs one process (it initialises the whole model and "
            f"exits), got world_size {world_size}; run scripts/create_seed_checkpoint.sh"
        )
    if ck.async_mode == "async_with_pinned_mem":
        if not torch.cuda.is_available():  # device-choice: pinned host memory only speeds device-to-host copies
            raise ConfigError(
                "checkpoint.async_mode = 'async_with_pinned_mem' stages into pinned memory for fast GPU-to-host "
                "copies, and this machine has no GPU; use 'async' (the state is already in host memory)"
            )
        raise NotImplementedError("checkpoint.async_mode = 'async_with_pinned_mem' is not built yet; use 'async'")


def validate_config(config: JobConfig, world_size: int, *, check_paths: bool = True) -> list[str]:
    """Raise on the first problem; return warnings (settings that have no effect).

    check_paths=False skips the checks of this machine: tokenizer/dataset files and CUDA for memory snapshots
    (the memory estimator reads no files and plans for the machine the run will use).
    """
    _check_ranges(config)
    _check_not_built(config)
    # About this machine, like the paths: the estimator plans for another one.
    if check_paths and config.profiling.enable_memory_snapshot and not torch.cuda.is_available():
        raise NotImplementedError(
            "profiling.enable_memory_snapshot = true: memory snapshots are CUDA's allocator history and this "
            "machine has no CUDA device; set it to false (profiling.enable_profiling traces CPU memory)"
        )
    _check_memory_options(config)
    dims = ParallelDims.from_config(config, world_size)  # raises on degrees that do not fit the world size
    if dims.dp_replicate_enabled and not dims.fsdp_enabled and dims.tp_enabled:
        raise NotImplementedError(
            "DDP (data_parallel_replicate_degree > 1, data_parallel_shard_degree = 1) with tensor parallel "
            "is not supported; use HSDP (data_parallel_shard_degree > 1) or FSDP with TP"
        )
    check_in_backward_config(config, dims)
    exp = config.experimental
    ring = dims.tp_enabled and exp.enable_async_tensor_parallel and exp.async_tensor_parallel_impl != "compiler"
    check_float8_config(
        config.float8, fsdp_enabled=dims.fsdp_enabled, ring_async_tp=ring and not config.training.compile
    )
    if check_paths and config.float8.enable_float8_linear and importlib.util.find_spec("torchao") is None:
        raise NotImplementedError(
            f"float8.enable_float8_linear = true needs torchao, which is not installed; pip install {TORCHAO_PIN}"
        )
    _check_model(config)
    attention_warnings = check_attention_config(config, dims, check_paths=check_paths)
    if check_paths:
        _check_paths(config)
    _check_validation_and_logging(config)
    _check_checkpoint(config, world_size)
    return attention_warnings + _warnings(config, world_size)
