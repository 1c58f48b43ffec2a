"""The typed config tree: one dataclass per TOML section, a help string per field.

The field help strings are what ``--help`` prints. Field names and sections accept the
late-2024 torchtitan schema so its published TOML files load unchanged; torchtitan's 2025 spellings are
translated onto these keys as they are read (config/compat_2025.py), so the tree has only these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torchtitan.config.bounds import Bound
from torchtitan.config.fields import POSITIVE as _POSITIVE
from torchtitan.config.fields import config_field as _f
from torchtitan.config.schema_checkpoint import Checkpoint
from torchtitan.config.schema_fault_tolerance import FaultTolerance
from torchtitan.config.schema_lora import Lora

# The names of torchtitan/datasets/registry.py's DATASETS (tests/unit/test_data_errors.py keeps them equal),
# spelled out here so that the config check knows them without importing the data stack.
DatasetName = Literal["pydocs", "pydocs_val", "c4", "c4_test", "c4_validation", "fineweb", "sft_arith", "sft_arith_val"]


# The names of models/llama/model.py's NORM_TYPES (tests/unit/test_config.py keeps them equal).
NORM_TYPES = ("rmsnorm", "fused_rmsnorm", "layernorm", "np_layernorm")


@dataclass
class Job:
    config_file: str | None = _f(None, "TOML file to load; its values override the defaults, CLI flags override it")
    dump_folder: str = _f("./outputs", "folder for everything a run writes: metrics.jsonl, config.toml, tb/, traces")
    description: str = _f("default job", "free text describing the run")
    use_for_integration_test: bool = _f(False, "marks configs that the integration tests may use")
    print_args: bool = _f(False, "print the resolved config at start")


@dataclass
class Profiling:
    enable_profiling: bool = _f(False, "record torch.profiler traces")
    save_traces_folder: str = _f("profile_traces", "trace folder, relative to job.dump_folder")
    profile_freq: int = _f(
        10, "record the last profiler_active steps of every N steps (profile_freq >= warmup + active)", bound=_POSITIVE
    )
    profiler_active: int = _f(1, "steps each trace records", bound=_POSITIVE)
    profiler_warmup: int = _f(
        1, "steps the profiler runs before each recorded window, unrecorded (its start-up cost)", bound=Bound(ge=0)
    )
    enable_memory_snapshot: bool = _f(
        False, "dump CUDA memory snapshots (CUDA only; refused on a machine without CUDA)"
    )
    save_memory_snapshot_folder: str = _f("memory_snapshot", "snapshot folder, relative to job.dump_folder")


@dataclass
class Metrics:
    log_freq: int = _f(10, "log metrics every N steps (each log syncs the device once)", bound=_POSITIVE)
    enable_tensorboard: bool = _f(False, "also write TensorBoard scalars")
    enable_color_printing: bool = _f(True, "colour the step log lines on a terminal")
    save_tb_folder: str = _f("tb", "TensorBoard folder, relative to job.dump_folder")
    rank_0_only: bool = _f(True, "only the logging rank writes metrics (the only mode supported)")
    enable_wandb: bool = _f(False, "also log to Weights & Biases (needs `pip install wandb`; WANDB_* env vars apply)")
    device_peak_flops: float = _f(
        0.0,
        "peak FLOP/s of one device for MFU; 0 = look up (GPU datasheet table) or measure once (CPU: the "
        "model's GEMMs in its dtype at the rank's thread count, cached). An MFU above 100% is never shown: "
        "the run warns that the peak is unreliable and names its source",
    )


@dataclass
class Model:
    name: str = _f("llama3", "model family: llama3")
    flavor: str = _f(
        "debugmodel",
        "model size, per model.name (docs/models.md): debugmodel, debugmodel_tiny (the parity tests' size) and "
        "the published sizes, e.g. llama3 1B, 3B, 8B, 70B, 405B",
    )
    norm_type: str = _f(
        "rmsnorm",
        "normalization layer: rmsnorm, fused_rmsnorm (the same nn.RMSNorm: torch 2.13 runs its fused kernel "
        "aten::_fused_rms_norm for both), layernorm, np_layernorm (no affine)",
        choices=NORM_TYPES,
    )
    attn_mask_type: Literal["causal", "block_causal"] = _f(
        "causal",
        "attention mask: 'causal' over the whole packed window, or 'block_causal': each token attends only to "
        "its own document (documents end at the tokenizer's EOS; the label after each EOS is ignored)",
    )
    positions_per_document: bool = _f(
        False, "with block_causal: RoPE positions restart at 0 at every document (default: window positions)"
    )
    attention_backend: Literal["auto", "sdpa", "flex"] = _f(
        "auto",
        "block_causal attention kernel: 'sdpa' (portable: one causal SDPA call per document, measured 7x faster "
        "than a masked SDPA on CPU), 'flex' (FlexAttention with a block mask built once per batch; CUDA only: "
        "torch 2.13 has no FlexAttention backward on CPU), 'auto' (flex on CUDA, sdpa elsewhere). Causal "
        "attention always runs SDPA; context parallel runs its ring attention",
    )
    tokenizer_path: str = _f(
        "./torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken",
        "tokenizer: a tiktoken BPE file (Llama 3's tokenizer.model), or a Hugging Face tokenizer.json or its "
        "folder (Qwen3's); scripts/download_tokenizer.py fetches both kinds",
    )


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = _f("AdamW", "optimizer")
    lr: float = _f(8e-4, "peak learning rate", bound=Bound(gt=0))
    eps: float = _f(1e-8, "Adam epsilon")
    beta1: float = _f(0.9, "Adam beta1")
    beta2: float = _f(0.95, "Adam beta2")
    weight_decay: float = _f(0.1, "decoupled weight decay (AdamW) or L2 penalty (Adam)")
    fused: bool = _f(False, "use the fused kernel (CUDA); default is the foreach implementation")
    state_dtype: Literal["float32", "bfloat16"] = _f(
        "float32",
        "dtype of Adam's exp_avg / exp_avg_sq; bfloat16 halves the optimizer state (the update still runs in fp32)",
    )
    early_step_in_backward: bool = _f(
        False,
        "step each parameter as soon as its gradient is final, during backward, and free that gradient (less "
        "memory: all gradients never live at once); needs training.max_norm = 0, gradient_accumulation_steps = 1, "
        "on_nonfinite = 'stop'; not with DDP or zero-bubble pipeline schedules (docs/compatibility.md)",
    )


@dataclass
class Training:
    dataset: DatasetName = _f(
        "pydocs",
        "dataset name: pydocs (shipped, offline), c4, c4_test, fineweb; sft_arith (shipped chat rows, for "
        "dataset_format = 'chat')",
    )
    dataset_path: str | None = _f(
        None, "local file/folder (or hub id; fine-tuning: a dataset in the local HF cache) to read the dataset from"
    )
    dataset_format: Literal["text", "chat", "prompt_completion"] = _f(
        "text",
        "text: pre-training documents, every token trained. chat ('messages': [{role, content}]) or "
        "prompt_completion ('prompt', 'completion'): fine-tuning rows, rendered with the tokenizer's chat template, "
        "packed whole into seq_len windows (needs model.attn_mask_type = 'block_causal' and "
        "model.positions_per_document), shuffled per epoch (docs/sft.md)",
    )
    loss_on: Literal["assistant", "completion", "all"] | None = _f(
        None,
        "fine-tuning: the tokens the loss is on: assistant turns (chat's default), the completion "
        "(prompt_completion's default; 'assistant' means the same there) or all; the loss is the mean over them "
        "across the global batch",
    )
    overlong_examples: Literal["truncate", "drop"] | None = _f(
        None, "fine-tuning: an example longer than seq_len is truncated (the default) or dropped; both are counted"
    )
    dataset_columns: list[str] | None = _f(
        None,
        "fine-tuning: the data's column names, as field=column for messages, prompt, completion, role, content "
        "(e.g. ['messages=conversations', 'role=from', 'content=value'])",
    )
    batch_size: int = _f(8, "samples per data-parallel rank per micro-batch", bound=_POSITIVE)
    seq_len: int = _f(2048, "tokens per sample", bound=_POSITIVE)
    warmup_steps: int = _f(
        200, "linear warmup steps of the learning rate (then what lr_schedule says)", bound=Bound(ge=0)
    )
    lr_schedule: Literal["linear", "wsd"] = _f(
        "linear",
        "the learning-rate schedule (components/lr_schedule.py): 'linear' = warmup (step+1)/(warmup_steps+1), then "
        "linear decay toward 0 at `steps` (torchtitan late 2024); 'wsd' = torchtitan 2025's warmup-stable-decay "
        "([lr_scheduler]): warmup (step+1)/warmup_steps, constant, then the last lr_decay_ratio of the steps decay "
        "(lr_decay_type) to lr_min_factor x optimizer.lr",
    )
    lr_decay_ratio: float | None = _f(
        None,
        "wsd: the fraction of `steps` that decay (warmup-stable-decay); None = every step after warmup",
        bound=Bound(ge=0, text=">= 0 (or unset)"),
    )
    lr_decay_type: Literal["linear", "sqrt", "cosine"] = _f(
        "linear", "wsd: the decay's shape: linear, sqrt (1 - sqrt(progress)) or cosine (half a period)"
    )
    lr_min_factor: float = _f(0.0, "wsd: the decay ends at lr_min_factor x optimizer.lr", bound=Bound(ge=0))
    max_norm: float = _f(
        1.0,
        "gradient-norm clipping threshold (total 2-norm over all parameters); 0 = no clipping",
        bound=Bound(ge=0, text=">= 0 (0 turns clipping off)"),
    )
    steps: int = _f(10000, "optimizer steps to train", bound=_POSITIVE)
    gradient_accumulation_steps: int = _f(1, "micro-batches accumulated per optimizer step", bound=_POSITIVE)
    data_parallel_replicate_degree: int = _f(1, "replicas (DDP, or the replicate axis of HSDP)", bound=_POSITIVE)
    data_parallel_shard_degree: int = _f(-1, "FSDP shard degree; -1 = whatever the other degrees leave")
    enable_cpu_offload: bool = _f(
        False, "FSDP CPU offload: sharded parameters, gradients and optimizer state live in CPU memory"
    )
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = _f(
        "default",
        "free each block's gathered parameters after forward: always; never (keep them for backward: fewer "
        "all-gathers, more memory); default = always except the last block",
    )
    fsdp_prefetch_depth: int = _f(
        1, "blocks FSDP all-gathers ahead of the one computing (forward and backward)", bound=_POSITIVE
    )
    tensor_parallel_degree: int = _f(1, "tensor-parallel degree", bound=_POSITIVE)
    enable_loss_parallel: bool = _f(True, "with TP, keep logits vocab-sharded and compute the loss in parallel")
    loss_chunk_size: int = _f(
        0,
        "sequence positions per chunk of the output projection + cross-entropy (each chunk's logits are "
        "recomputed in backward, never all held); 0 = one chunk (the full logits)",
        bound=Bound(ge=0, text=">= 0 (0 = one chunk, the full logits)"),
    )
    mixed_precision_param: Literal["bfloat16", "float32"] = _f(
        "bfloat16", "parameter dtype in forward/backward (FSDP MixedPrecisionPolicy, else autocast)"
    )
    mixed_precision_reduce: Literal["float32", "bfloat16"] = _f("float32", "gradient reduction dtype under FSDP")
    compile: bool = _f(False, "torch.compile each transformer block")
    compile_loss: bool = _f(
        False,
        "torch.compile the cross-entropy loss (its fp32 upcast and log-softmax fuse, so the fp32 logits' copies are "
        "not all held); not with loss_chunk_size > 0, whose chunks are recomputed in backward",
    )
    gc_freq: int = _f(
        50, "run Python garbage collection every N steps (automatic GC is off while training)", bound=_POSITIVE
    )
    seed: int | None = _f(None, "seed for weights init; None = 0. Weights depend only on it, not on the layout")
    deterministic: bool = _f(False, "use deterministic algorithms (slower)")
    on_nonfinite: Literal["stop", "skip"] = _f(
        "stop",
        "a step whose loss or grad norm is NaN/inf (checked on every rank before the optimizer step): stop "
        "(exit 4 naming the step; the last good checkpoint is kept) or skip (drop its update)",
    )
    max_nonfinite_skips: int = _f(
        3, "with on_nonfinite = 'skip': stop after this many skipped steps in a row", bound=_POSITIVE
    )


@dataclass
class Validation:
    enabled: bool = _f(False, "compute the loss on held-out data every `freq` steps and at the last step")
    freq: int = _f(10, "validate every N training steps", bound=_POSITIVE)
    steps: int = _f(
        2, "batches per validation (the same batches every time, so values compare over time)", bound=_POSITIVE
    )
    dataset: DatasetName = _f(
        "pydocs_val",
        "validation dataset name (pydocs_val = held out of pydocs; sft_arith_val = held out of sft_arith); read "
        "in training.dataset_format, so fine-tuning reports the masked loss",
    )
    dataset_path: str | None = _f(None, "local file/folder (or hub id) to read the validation data from")
    batch_size: int | None = _f(
        None,
        "samples per data-parallel rank per batch; None = batch_size x gradient_accumulation_steps",
        bound=Bound(ge=1, text=">= 1 (or unset)"),
    )


@dataclass
class Experimental:
    context_parallel_degree: int = _f(
        1, "context-parallel degree: ranks that split each sequence (ring attention)", bound=_POSITIVE
    )
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = _f(
        "allgather",
        "how ring attention gets the other ranks' keys/values: allgather (all at once; K/V memory x cp) or "
        "alltoall (passed around the ring one block at a time, overlapping the next transfer with compute)",
    )
    context_parallel_load_balance: bool = _f(
        True, "give each CP rank a head and the mirrored tail chunk of the sequence, so causal work is even"
    )
    context_parallel_impl: Literal["portable", "torch"] = _f(
        "portable",
        "ring attention implementation: portable (ours, any device/backend/torch) or torch (torch's "
        "experimental ring attention: CUDA flash/efficient/cuDNN kernels, and on CPU through our handlers "
        "for its CPU kernel; private torch names, checked on torch 2.11 to 2.15)",
    )
    pipeline_parallel_degree: int = _f(
        1,
        "pipeline-parallel degree: ranks the layers are split over as stages (the outermost mesh axis); 1 = off",
        bound=_POSITIVE,
    )
    pipeline_parallel_split_points: list[str] = _f([], "layer names where stages start, e.g. layers.4,layers.8")
    pipeline_parallel_schedule: str = _f(
        "1F1B",
        "pipeline schedule name (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, "
        "DualPipeV); with pipeline_parallel_schedule_csv, the stage placement the CSV was written for: 'loop' "
        "or PipelineScheduleMulti (several stages per rank, stage s on rank s % pp), "
        "PipelineScheduleSingle (one stage per rank), 'v' (V-shaped, 2 per rank)",
    )
    pipeline_parallel_schedule_csv: str = _f(
        "", "CSV file of a custom pipeline schedule (compute actions, one row per pp rank; docs/pipeline_parallel.md)"
    )
    pipeline_parallel_microbatches: int | None = _f(None, "pipeline micro-batches; None = the pp degree")
    enable_async_tensor_parallel: bool = _f(False, "overlap TP communication with the matmuls (needs TP)")
    async_tensor_parallel_impl: Literal["auto", "ring", "compiler"] = _f(
        "auto",
        "async TP implementation: 'ring' = ours, chunked P2P ring on any backend; 'compiler' = torch's "
        "symmetric-memory micro-pipeline pass (CUDA + training.compile); 'auto' = compiler where it "
        "can run, else ring",
    )
    expert_parallel_degree: int = _f(
        1,
        "expert-parallel degree (MoE models): ranks that split each MoE layer's experts; taken from "
        "data_parallel_shard_degree and, with TP, contains the TP ranks (ep = tp x k, k dividing dp_shard)",
        bound=_POSITIVE,
    )
    enable_compiled_autograd: bool = _f(
        False, "compile the backward graph too (not built yet)", not_built="compiled autograd"
    )


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "selective", "full"] = _f("selective", "activation checkpointing mode")
    selective_ac_option: str = _f("2", "'N' = checkpoint every N-th block, 'op' = save selected ops' outputs")


@dataclass
class Float8:
    enable_float8_linear: bool = _f(
        False,
        "train the model's linears in float8 with torchao (the output head and linears whose dims are not "
        "multiples of 16 stay in high precision); refused where this torch/device cannot run float8 GEMMs",
    )
    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"] = _f(
        "tensorwise",
        "scaling: 'tensorwise' (one scale per tensor; composes with float8 FSDP all-gather and float8 TP), "
        "'rowwise' (one per row), 'rowwise_with_gw_hp' (rowwise, weight grad in high precision); 'mxfp8' is refused",
    )
    filter_fqns: list[str] = _f([], "modules kept in high precision: a linear whose name contains one of these")
    enable_fsdp_float8_all_gather: bool = _f(
        False, "FSDP all-gathers the weights in float8 (tensorwise only; needs data_parallel_shard_degree > 1)"
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = _f(
        False, "one all-reduce after each optimizer step computes every weight's float8 scale (needs the above)"
    )
    force_recompute_fp8_weight_in_bwd: bool = _f(
        False, "recast the weight to float8 in backward instead of saving it (less memory; tensorwise only)"
    )
    scaling_type_input: Literal["dynamic", "delayed"] = _f("dynamic", "torchtitan's older key: only 'dynamic'")
    scaling_type_weight: Literal["dynamic", "delayed"] = _f("dynamic", "torchtitan's older key: only 'dynamic'")
    scaling_type_grad_output: Literal["dynamic", "delayed"] = _f("dynamic", "torchtitan's older key: only 'dynamic'")


@dataclass
class Comm:
    init_timeout_seconds: int = _f(
        300, "timeout of process-group init and the first step's collectives", bound=_POSITIVE
    )
    train_timeout_seconds: int = _f(100, "timeout of collectives after the first step", bound=_POSITIVE)
    trace_buf_size: int = _f(
        20000, "NCCL flight-recorder entries for post-mortem dumps, 0 = off (NCCL only; no effect on gloo/CPU)"
    )


@dataclass
class MemoryEstimation:
    enabled: bool = _f(
        False,
        "estimate memory before training (not built yet; use estimation.py)",
        not_built="memory estimation in the trainer",
    )


# Older spellings that still load: alias -> the canonical key it negates (``disable_x = true`` means
# ``enable_x = false``). The parser maps them onto the canonical key, so the tree has no such field.
# Both are spellings torchtitan's own config used (late 2024 / early 2025).
NEGATED_ALIASES: dict[str, str] = {
    "metrics.disable_color_printing": "metrics.enable_color_printing",
    "training.disable_loss_parallel": "training.enable_loss_parallel",
}


@dataclass
class JobConfigTree:
    """Field order here is the section order of --help and of the dumped config."""

    job: Job = field(default_factory=Job)
    profiling: Profiling = field(default_factory=Profiling)
    metrics: Metrics = field(default_factory=Metrics)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    training: Training = field(default_factory=Training)
    validation: Validation = field(default_factory=Validation)
    experimental: Experimental = field(default_factory=Experimental)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    float8: Float8 = field(default_factory=Float8)
    lora: Lora = field(default_factory=Lora)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
