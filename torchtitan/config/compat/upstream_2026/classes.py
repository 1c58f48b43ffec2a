"""Stand-ins for the config classes of upstream torchtitan's 2026 ``Trainer.Config`` (pytorch/torchtitan b5bcd76c6).

Each class has upstream's field names and defaults and nothing else: a recipe builds and edits one as it would
upstream's, and config/compat/keys_2026.py reads the result onto this trainer's keys. Setting a field a class does
not have raises at the recipe's line (``AttributeError`` naming the field, the class, the close spellings), where
upstream's would too. The parts upstream builds from code (the model, the loss, the data pipeline) are small
records of what upstream's registry functions put there (``ModelSpec``, ``Loss``, ``Data``).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any


class _Fields:
    """Refuse an attribute that is no field, in one line, where the recipe sets it."""

    def __setattr__(self, name: str, value: Any) -> None:
        names = [f.name for f in dataclasses.fields(self)]
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise AttributeError(
                f"{type(self).__qualname__} has no field '{name}'{hint}: upstream torchtitan 2026's fields: "
                f"{', '.join(names)}"
            )
        object.__setattr__(self, name, value)


@dataclass(kw_only=True)
class TrainingConfig(_Fields):
    num_tokens_per_microbatch_per_dp_rank: int = 16384
    num_tokens_per_train_step: int = -1
    max_context_length: int = 2048
    max_norm: float = 1.0
    steps: int = 10000
    enable_cpu_offload: bool = False
    disable_cuda_graphs: bool = False
    dtype: str = "float32"
    mixed_precision_param: str = "bfloat16"
    mixed_precision_reduce: str = "float32"
    gc_freq: int = 50
    gc_debug: bool = False


@dataclass(kw_only=True)
class ParallelismConfig(_Fields):
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    fsdp_reshard_after_forward: str = "default"
    enable_fsdp_symm_mem: bool = False
    tensor_parallel_degree: int = 1
    enable_sequence_parallel: bool = True
    spmd_backend: str = "spmd_types"
    pipeline_parallel_degree: int = 1
    module_fqns_per_model_part: list[list[str]] | None = None
    pipeline_parallel_first_stage_less_layers: int = 1
    pipeline_parallel_last_stage_less_layers: int = 1
    pipeline_parallel_layers_per_stage: int | None = None
    pipeline_parallel_schedule: str = "1F1B"
    pipeline_parallel_schedule_csv: str | None = ""
    num_pp_microbatches: int = 1
    context_parallel_degree: int = 1
    context_parallel_load_balancer: str | None = "headtail"
    context_parallel_ptrr_mask_key: str | None = None
    expert_parallel_degree: int = 1


@dataclass(kw_only=True)
class CompileConfig(_Fields):
    enable: bool = False
    enable_async_tensor_parallel: bool = False
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    backend: str = "inductor"


@dataclass(kw_only=True)
class CommConfig(_Fields):
    init_timeout_seconds: int = 300
    train_timeout_seconds: int = 100
    trace_buf_size: int = 20000
    save_traces_folder: str = "comm_traces"
    save_traces_file_prefix: str = "rank_"
    mode: str = "default"


@dataclass(kw_only=True)
class DebugConfig(_Fields):
    seed: int | None = None
    spmd_typechecking: bool = False
    deterministic: bool = False
    deterministic_warn_only: bool = False
    moe_force_load_balance: bool = False
    detect_anomaly: bool = False
    batch_invariant: bool = False
    print_config: bool = False
    save_config_file: str | None = None
    enable_structured_logging: bool = True


@dataclass(kw_only=True)
class OverrideConfig(_Fields):
    imports: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class ProfilerConfig(_Fields):
    enable_profiling: bool = False
    save_traces_folder: str = "profile_traces"
    profile_freq: int = 10
    profiler_repeat: int | None = None
    profiler_skip_first: int | None = None
    profiler_skip_first_wait: int | None = None
    profiler_active: int = 1
    profiler_warmup: int = 3
    enable_memory_snapshot: bool = False
    memory_snapshot_freq: int | None = None
    save_memory_snapshot_folder: str = "memory_snapshot"
    memory_snapshot_max_entries: int = 1000000
    trace_post_processor: Any = None


@dataclass(kw_only=True)
class MetricsConfig(_Fields):
    log_freq: int = 10
    enable_tensorboard: bool = False
    disable_color_printing: bool = False
    save_tb_folder: str = "tb"
    save_for_all_ranks: bool = False
    enable_wandb: bool = False


@dataclass(kw_only=True)
class CheckpointConfig(_Fields):
    enable: bool = False
    folder: str = "checkpoint"
    interval: int = 500
    initial_load_path: str | None = None
    initial_load_model_only: bool = True
    initial_load_in_hf: bool = False
    initial_load_in_hf_quantized: bool = False
    last_save_model_only: bool = True
    last_save_in_hf: bool = False
    export_dtype: str = "float32"
    keep_latest_k: int = 10
    load_step: int = -1
    exclude_from_loading: list[str] = field(default_factory=list)
    enable_first_step_checkpoint: bool = False
    create_seed_checkpoint: bool = False
    load_only: bool = False
    async_mode: str = "disabled"


@dataclass(kw_only=True)
class ParamGroup(_Fields):
    pattern: str = r".*"
    optimizer_name: str = "AdamW"
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class OptimizerConfig(_Fields):
    param_groups: list[ParamGroup] = field(default_factory=list)
    implementation: str = "fused"
    optimizer_factory_kwargs_by_name: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(kw_only=True)
class LRSchedulerConfig(_Fields):
    warmup_steps: int = 200
    total_steps: int | None = None
    decay_ratio: float | None = None
    decay_type: str = "linear"
    min_lr_factor: float = 0.0


@dataclass(kw_only=True)
class Data(_Fields):
    """What upstream's data loader config names: the dataset (``DATASETS[name]``) and how it is read."""

    dataset: str | None = None  # a name of upstream's DATASETS
    path: str | None = None  # a local file instead (upstream's HuggingFaceRandomAccessSource of json rows)
    chat: bool = False  # an SFT ChatDataset (rows of chat messages) rather than packed text
    shuffle: bool = True
    seed: int = 42


@dataclass(kw_only=True)
class ValidatorConfig(_Fields):
    freq: int = 10
    enable: bool = False
    steps: int = -1
    dataloader: Data = field(default_factory=lambda: Data(dataset="c4_validation"))


@dataclass(kw_only=True)
class ActivationCheckpointConfig(_Fields):
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    debug: bool = False


@dataclass(kw_only=True)
class FullACConfig(ActivationCheckpointConfig):
    pass


@dataclass(kw_only=True)
class SelectiveACConfig(ActivationCheckpointConfig):
    force_recompute_mm_shapes_by_fqns: list[str] = field(default_factory=lambda: ["moe.router.gate"])


@dataclass(kw_only=True)
class MemoryBudgetACConfig(ActivationCheckpointConfig):
    memory_budget: float = 0.5
    visualize_memory_budget_pareto: bool = False


@dataclass(kw_only=True)
class ModelSpec(_Fields):
    """What upstream's ``model_registry(flavor, ...)`` of a family returns, as the arguments that chose it."""

    name: str
    flavor: str
    attn_backend: str = "flex"
    converters: list[Any] = field(default_factory=list)  # Float8 / LoRA converter records, in order


@dataclass(kw_only=True)
class Float8Converter(_Fields):
    emulate: bool = False
    model_compile_enabled: bool = False


@dataclass(kw_only=True)
class LoRAConverter(_Fields):
    rank: int = 8
    alpha: float = 16.0
    target_modules: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class Loss(_Fields):
    """Upstream's loss config: cross-entropy over the whole sequence, or in ``num_chunks`` chunks."""

    chunked: bool = True
    num_chunks: int = 8


@dataclass(kw_only=True)
class TrainerConfig(_Fields):
    """Upstream's ``Trainer.Config`` (torchtitan/trainer.py), field for field."""

    model_spec: ModelSpec | None = None
    hf_assets_path: str = "./tests/assets/tokenizer"
    dump_folder: str = "./outputs"
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    tokenizer: Any = None  # upstream's HuggingFaceTokenizer.Config(): it reads hf_assets_path
    dataloader: Data = field(default_factory=Data)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    activation_checkpoint: ActivationCheckpointConfig | None = field(default_factory=SelectiveACConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    validator: ValidatorConfig = field(default_factory=ValidatorConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    override: OverrideConfig = field(default_factory=OverrideConfig)
    loss: Loss = field(default_factory=Loss)
