"""Upstream torchtitan's 2026 ``Trainer.Config`` (pytorch/torchtitan b5bcd76c6) read as this trainer's config.

A recipe function of upstream's (``--module torchtitan_recipes.tests.features --config F``; the names it imports:
config/compat/upstream_2026) returns a ``Trainer.Config``; ``config_table`` turns it into the ``[section] key =
value`` tables a TOML file would give, so the same parser checks it and the flags go on top. Every field of it has
one rule here (``RULES``, by its dotted path; the docs' "2026 configurations" table and its test are made from it):

* ``To(target, convert)``: the same setting at this trainer's key ``target`` (or a 2025 spelling whose rule in
  keys_2025 does the rest, e.g. ``training.global_batch_size``), its value converted where the meaning is spelled
  differently. Upstream's defaults are taken over too: the run is the one upstream's recipe describes.
* ``Fixed`` (config/compat/spellings.py): accepted at the values that mean what this trainer does; any other is
  refused before launch in one line naming the field (``NotImplementedError``).
* ``Warns(quiet, why)``: no key here, as it changes only speed (a kernel, CUDA graphs, a stage balance) or only a
  check; a value other than ``quiet`` is accepted and said once, in a warning.
* ``Computed(what)``: read with other fields (the token budget, the model, the loss, the data, the AC choice).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan.config.compat.spellings import Fixed, describe
from torchtitan.config.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class To:
    target: str
    convert: Callable[[Any], Any] | None = None
    note: str = ""
    extra: Callable[[Any], dict[str, Any]] | None = None  # value -> other keys of ours it also sets
    said: Callable[[Any], str | None] | None = None  # value -> a speed-only difference, said once (None: none)


@dataclass(frozen=True)
class Warns:
    quiet: Any  # the value that changes nothing here (upstream's default, or the value that turns it off)
    why: str
    only_with_pp: bool = False  # said only with pipeline parallel (a field that acts only there upstream)


@dataclass(frozen=True)
class Computed:
    what: str


Rule2026 = To | Fixed | Warns | Computed

_SPEED = "speed only"
_PP = "with pipeline parallel: "
_TRACES = "NCCL's flight-recorder dumps go where TORCH_NCCL_DEBUG_INFO_TEMP_FILE says; set that variable instead"
_TOKENS = (
    "the token budget: seq_len = max_context_length, batch_size = tokens per micro-batch / seq_len "
    "(x num_pp_microbatches with pipeline parallel, = experimental.pipeline_parallel_microbatches), "
    "gradient_accumulation_steps = num_tokens_per_train_step / (tokens per micro-batch x pp micro-batches x dp); "
    "tokens must be whole sequences"
)


def _not(value: bool) -> bool:
    return not value


def _implementation(value: str) -> bool:
    if value == "for-loop":
        raise NotImplementedError("'for-loop' is not built: the optimizer runs 'foreach' or 'fused'")
    if value not in ("foreach", "fused", "fused_opt_states_bf16"):
        raise ConfigError(f"got {value!r}; allowed: 'foreach', 'fused', 'fused_opt_states_bf16'")
    return (
        value == "fused"
    )  # fused_opt_states_bf16: foreach here (torch's fused kernel keeps states in the param dtype)


def _bf16_states(value: str) -> dict[str, Any]:
    return {"optimizer.state_dtype": "bfloat16"} if value == "fused_opt_states_bf16" else {}


def _unfused(value: str) -> str | None:
    if value != "fused_opt_states_bf16":
        return None
    return "the update runs unfused here (speed only): torch's fused kernel keeps its states in the parameters' dtype"


def _wsd(value: Any) -> dict[str, Any]:
    return {"training.lr_schedule": "wsd"}


def _load_balancer(value: str | None) -> bool:
    if value not in ("headtail", None):
        raise NotImplementedError(f"{value!r} is not built; 'headtail' (our load balance) or None (none)")
    return value == "headtail"


def _csv(value: str | None) -> str:
    return value or ""


RULES: dict[str, Rule2026] = {
    "model_spec": Computed(
        "model.name, model.flavor (our size of each debug flavor); attn_backend flex / flex_flash / varlen: "
        "upstream's language models always mask per document (block_causal, positions restart per document), "
        "kernels aside (said once); Float8 converter -> float8.enable_float8_linear (emulate refused); LoRA "
        "converter -> [lora] (wkv = wk + wv)"
    ),
    "hf_assets_path": To("model.tokenizer_path", note="the tokenizer folder (tokenizer.json, tokenizer_config.json)"),
    "dump_folder": To("job.dump_folder"),
    "tokenizer": Fixed(object, None, "the tokenizer is read from hf_assets_path (upstream's default tokenizer)"),
    "dataloader": Computed(
        "training.dataset (a DATASETS name) or training.dataset_path (a file); a chat dataset: dataset_format "
        "'chat', loss on the assistant's tokens; shuffle = True is said once (the data is read in order here)"
    ),
    "loss": Computed(
        "ChunkedLossWrapper(num_chunks) -> training.loss_chunk_size = max_context_length / num_chunks (with the "
        "loss compiled or pipeline parallel: 0, memory only, said once); CrossEntropyLoss -> 0 (the full logits)"
    ),
    "activation_checkpoint": Computed(
        "None -> activation_checkpoint.mode 'none'; FullAC -> 'full'; SelectiveAC -> 'selective', op-level; "
        "MemoryBudgetAC -> 'memory_budget' and its budget"
    ),
    "activation_checkpoint.preserve_rng_state": Fixed(
        bool, True, "no randomness runs in a recomputed block here (no dropout): nothing to preserve", also=(False,)
    ),
    "activation_checkpoint.determinism_check": Fixed(str, "default", "AC here runs torch's default check"),
    "activation_checkpoint.debug": Fixed(bool, False, "AC debug capture is not built"),
    "activation_checkpoint.force_recompute_mm_shapes_by_fqns": Fixed(
        list,
        ["moe.router.gate"],
        "op-level AC here saves every other matmul; which it recomputes is memory only",
        also=([],),
    ),
    "activation_checkpoint.memory_budget": Computed("activation_checkpoint.memory_budget (with MemoryBudgetAC)"),
    "activation_checkpoint.visualize_memory_budget_pareto": Fixed(bool, False, "no Pareto plot of the budgets"),
    "training.num_tokens_per_microbatch_per_dp_rank": Computed(_TOKENS),
    "training.num_tokens_per_train_step": Computed("see num_tokens_per_microbatch_per_dp_rank"),
    "training.max_context_length": Computed("training.seq_len; see num_tokens_per_microbatch_per_dp_rank"),
    "training.max_norm": To("training.max_norm"),
    "training.steps": To("training.steps"),
    "training.enable_cpu_offload": To("training.enable_cpu_offload"),
    "training.disable_cuda_graphs": Warns(
        True,
        f"{_SPEED}: capturing the whole step as CUDA graphs is not built; steps run as launched (compiled "
        "blocks may use training.cuda_graphs, compile's own)",
    ),
    "training.dtype": To("training.dtype"),
    "training.mixed_precision_param": To("training.mixed_precision_param"),
    "training.mixed_precision_reduce": To("training.mixed_precision_reduce"),
    "training.gc_freq": To("training.gc_freq"),
    "training.gc_debug": Fixed(bool, False, "the per-step gc debugging mode is not built"),
    "parallelism.data_parallel_replicate_degree": To("training.data_parallel_replicate_degree"),
    "parallelism.data_parallel_shard_degree": To("training.data_parallel_shard_degree"),
    "parallelism.fsdp_reshard_after_forward": To("training.fsdp_reshard_after_forward"),
    "parallelism.enable_fsdp_symm_mem": Warns(False, f"{_SPEED}: FSDP's collectives over CUDA symmetric memory"),
    "parallelism.tensor_parallel_degree": To("training.tensor_parallel_degree"),
    "parallelism.enable_sequence_parallel": Warns(
        True,
        f"{_SPEED} and memory: TP here always shards the norms' activations over the sequence; the math is the same",
    ),
    "parallelism.spmd_backend": Fixed(
        str,
        "spmd_types",
        "how upstream's code types its sharded tensors; TP here is DTensor's, the same math either way",
        also=("partial_dtensor",),
    ),
    "parallelism.pipeline_parallel_degree": To("experimental.pipeline_parallel_degree"),
    "parallelism.module_fqns_per_model_part": To(
        "parallelism.module_fqns_per_model_part", note="as the 2025 key: parts of consecutive layers -> split points"
    ),
    "parallelism.pipeline_parallel_first_stage_less_layers": Warns(
        0, f"{_PP}{_SPEED}: which stage holds which layers; our stages split the layers evenly", only_with_pp=True
    ),
    "parallelism.pipeline_parallel_last_stage_less_layers": Warns(
        0, f"{_PP}{_SPEED}: which stage holds which layers; our stages split the layers evenly", only_with_pp=True
    ),
    "parallelism.pipeline_parallel_layers_per_stage": Warns(
        None,
        f"{_PP}{_SPEED}: stage sizes; here one stage per rank (single-stage schedules) or two (multi-stage), "
        "layers split evenly",
        only_with_pp=True,
    ),
    "parallelism.pipeline_parallel_schedule": To("experimental.pipeline_parallel_schedule"),
    "parallelism.pipeline_parallel_schedule_csv": To("experimental.pipeline_parallel_schedule_csv", _csv),
    "parallelism.num_pp_microbatches": Computed("experimental.pipeline_parallel_microbatches; see the token budget"),
    "parallelism.context_parallel_degree": To("experimental.context_parallel_degree"),
    "parallelism.context_parallel_load_balancer": To(
        "experimental.context_parallel_load_balance", _load_balancer, note="'headtail' -> true, None -> false"
    ),
    "parallelism.context_parallel_ptrr_mask_key": Fixed(object, None, "PTRR load balancing is not built"),
    "parallelism.expert_parallel_degree": To("experimental.expert_parallel_degree"),
    "compile.enable": To("compile.enable", note="as the 2025 key: training.compile, with components"),
    "compile.enable_async_tensor_parallel": To("experimental.enable_async_tensor_parallel"),
    "compile.components": To("compile.components", note="as the 2025 key: 'model' -> compile, 'loss' -> compile_loss"),
    "compile.backend": Fixed(str, "inductor", "compile uses torch.compile's default backend, inductor"),
    "comm.init_timeout_seconds": To("comm.init_timeout_seconds"),
    "comm.train_timeout_seconds": To("comm.train_timeout_seconds"),
    "comm.trace_buf_size": To("comm.trace_buf_size"),
    "comm.save_traces_folder": Fixed(str, "comm_traces", _TRACES),
    "comm.save_traces_file_prefix": Fixed(str, "rank_", _TRACES),
    "comm.mode": Fixed(
        str, "default", "torchcomms and the fake / local-tensor dry runs are not built (dry runs: torchtitan.preflight)"
    ),
    "debug.seed": To("training.seed"),
    "debug.spmd_typechecking": Warns(False, "a check of upstream's SPMD type annotations, which this code has none of"),
    "debug.deterministic": To("training.deterministic"),
    "debug.deterministic_warn_only": Fixed(bool, False, "deterministic mode here raises on a nondeterministic op"),
    "debug.moe_force_load_balance": Fixed(bool, False, "forced round-robin routing is not built"),
    "debug.detect_anomaly": Fixed(bool, False, "autograd anomaly detection is not built in"),
    "debug.batch_invariant": Fixed(bool, False, "batch-invariant kernels are not built (upstream refuses it too)"),
    "debug.print_config": To("job.print_args"),
    "debug.save_config_file": Fixed(object, None, "the resolved config is always written to <dump_folder>/config.toml"),
    "debug.enable_structured_logging": Fixed(bool, True, "the log format here is its own", also=(False,)),
    "override.imports": Computed(
        "upstream's fused SwiGLU / fused grouped experts (fused_swiglu.fused_swiglu, .fused_grouped_experts): the "
        "same math in one GEMM and a Triton kernel, speed only (said once); any other override refused"
    ),
    "profiler.enable_profiling": To("profiling.enable_profiling"),
    "profiler.save_traces_folder": To("profiling.save_traces_folder"),
    "profiler.profile_freq": To("profiling.profile_freq"),
    "profiler.profiler_repeat": Fixed(object, None, "traces repeat every profile_freq steps"),
    "profiler.profiler_skip_first": Fixed(object, None, "skipping first steps is not built"),
    "profiler.profiler_skip_first_wait": Fixed(object, None, "skipping first steps is not built"),
    "profiler.profiler_active": To("profiling.profiler_active"),
    "profiler.profiler_warmup": To("profiling.profiler_warmup"),
    "profiler.enable_memory_snapshot": To("profiling.enable_memory_snapshot"),
    "profiler.memory_snapshot_freq": Fixed(object, None, "a memory snapshot is taken at the profile_freq steps"),
    "profiler.save_memory_snapshot_folder": To("profiling.save_memory_snapshot_folder"),
    "profiler.memory_snapshot_max_entries": Fixed(int, 1000000, "the allocator history keeps torch's default"),
    "profiler.trace_post_processor": Fixed(object, None, "trace post-processing is not built"),
    "metrics.log_freq": To("metrics.log_freq"),
    "metrics.enable_tensorboard": To("metrics.enable_tensorboard"),
    "metrics.disable_color_printing": To("metrics.enable_color_printing", _not, note="= not enable_color_printing"),
    "metrics.save_tb_folder": To("metrics.save_tb_folder"),
    "metrics.save_for_all_ranks": To("metrics.save_for_all_ranks", note="as the 2025 key: = not rank_0_only"),
    "metrics.enable_wandb": To("metrics.enable_wandb"),
    "checkpoint.enable": To("checkpoint.enable_checkpoint"),
    "checkpoint.folder": To("checkpoint.folder"),
    "checkpoint.interval": To("checkpoint.interval"),
    "checkpoint.initial_load_path": To("checkpoint.initial_load_path"),
    "checkpoint.initial_load_model_only": To("checkpoint.initial_load_model_only", note="as the 2025 key: true only"),
    "checkpoint.initial_load_in_hf": To("checkpoint.initial_load_in_hf"),
    "checkpoint.initial_load_in_hf_quantized": Fixed(bool, False, "loading quantized Hugging Face weights: not built"),
    "checkpoint.last_save_model_only": To("checkpoint.model_weights_only"),
    "checkpoint.last_save_in_hf": To("checkpoint.last_save_in_hf"),
    "checkpoint.export_dtype": To("checkpoint.export_dtype"),
    "checkpoint.keep_latest_k": To("checkpoint.keep_latest_k"),
    "checkpoint.load_step": To("checkpoint.load_step"),
    "checkpoint.exclude_from_loading": To("checkpoint.exclude_from_loading"),
    "checkpoint.enable_first_step_checkpoint": Fixed(bool, False, "a checkpoint after the first step is not built"),
    "checkpoint.create_seed_checkpoint": To("checkpoint.create_seed_checkpoint"),
    "checkpoint.load_only": Fixed(bool, False, "loading without ever saving is not built"),
    "checkpoint.async_mode": To("checkpoint.async_mode"),
    "optimizer.param_groups": Computed(
        "one AdamW / Adam group over every parameter (pattern '.*', default_adamw) -> optimizer.name, lr, beta1, "
        "beta2, eps, weight_decay; other groups refused"
    ),
    "optimizer.implementation": To(
        "optimizer.fused",
        _implementation,
        note="'fused' -> fused; 'foreach' -> not; 'fused_opt_states_bf16' -> optimizer.state_dtype 'bfloat16', "
        "not fused (torch's fused kernel keeps its states in the parameters' dtype; fused is speed only: said once); "
        "'for-loop' refused",
        extra=_bf16_states,
        said=_unfused,
    ),
    "optimizer.optimizer_factory_kwargs_by_name": Fixed(dict, {}, "optimizer factory arguments are not built"),
    "lr_scheduler.warmup_steps": To(
        "training.warmup_steps", note="+ training.lr_schedule = 'wsd' (upstream's)", extra=_wsd
    ),
    "lr_scheduler.total_steps": Fixed(object, None, "the schedule spans training.steps"),
    "lr_scheduler.decay_ratio": To("training.lr_decay_ratio"),
    "lr_scheduler.decay_type": To("training.lr_decay_type"),
    "lr_scheduler.min_lr_factor": To("training.lr_min_factor"),
    "validator.enable": To("validation.enabled"),
    "validator.freq": To("validation.freq"),
    "validator.steps": To("validation.steps", note="-1 (the whole set) refused by validation.steps' range"),
    "validator.dataloader": Computed("validation.dataset (a DATASETS name) or validation.dataset_path"),
}


def describe_2026(rule: Rule2026) -> str:
    """One line for --help and docs/compatibility.md's 2026 table."""
    if isinstance(rule, To):
        return f"-> {rule.target}" + (f" ({rule.note})" if rule.note else "")
    if isinstance(rule, Fixed):
        return describe(rule)
    if isinstance(rule, Warns):
        return f"no effect here, said once unless {rule.quiet!r}: {rule.why}"
    return rule.what


def _kind(rule: Rule2026) -> str:
    if isinstance(rule, To):
        return "maps"
    if isinstance(rule, Fixed):
        return "refused unless " + " or ".join(repr(v) for v in (rule.value, *rule.also))
    return "warns" if isinstance(rule, Warns) else "computed"


def help_2026() -> list[str]:
    """--help's section on upstream's 2026 Trainer.Config fields (the recipes of --module torchtitan_recipes.*)."""
    out = ["", "[upstream torchtitan 2026 Trainer.Config fields] (--module torchtitan_recipes.tests.features --config F;"
           " docs/compatibility.md, 2026 configurations)"]  # fmt: skip
    return out + [f"  Trainer.Config.{path}: {describe_2026(rule)}" for path, rule in RULES.items()]


def markdown_table() -> str:
    """docs/compatibility.md's 2026 field table (tests/unit/test_config_2026.py holds the docs to it)."""
    rows = ["| upstream `Trainer.Config` field | here | what it means here |", "|---|---|---|"]
    for path, rule in RULES.items():
        text = describe_2026(rule).replace("|", "\\|")
        rows.append(f"| `{path}` | {_kind(rule)} | {text} |")
    return "\n".join(rows)
