"""The typed config tree: one dataclass per TOML section, a help string per field.

The field help strings are what ``--help`` prints. Field names and sections accept the
late-2024 torchtitan schema so its published TOML files load unchanged; torchtitan's 2025 spellings are
translated onto these keys as they are read (config/compat/keys_2025.py), so the tree has only these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torchtitan.config.bounds import Bound
from torchtitan.config.fields import POSITIVE as _POSITIVE
from torchtitan.config.fields import config_field as _f
from torchtitan.config.sections.checkpoint import Checkpoint
from torchtitan.config.sections.eval import Eval
from torchtitan.config.sections.fault_tolerance import FaultTolerance
from torchtitan.config.sections.lora import Lora
from torchtitan.config.sections.metrics import Metrics
from torchtitan.config.sections.optimizer import Optimizer
from torchtitan.config.sections.rl import Rl
from torchtitan.config.sections.training import DatasetName, Training

# The names of models/llama/model.py's NORM_TYPES (tests/unit/test_config.py keeps them equal).
NORM_TYPES = ("rmsnorm", "fused_rmsnorm", "layernorm", "np_layernorm")


@dataclass
class Job:
    config_file: str | None = _f(None, "TOML file to load; its values override the defaults, CLI flags override it")
    dump_folder: str = _f(
        "./outputs",
        "local folder for everything a run writes: metrics.jsonl, config.toml, tb/, traces (not a URL: "
        "checkpoint.folder may be one)",
    )
    description: str = _f("default job", "free text describing the run")
    use_for_integration_test: bool = _f(False, "marks configs that the integration tests may use")
    print_args: bool = _f(False, "print the resolved config at start")
    log_level: Literal["debug", "info", "warning"] = _f(
        "info",
        "what the run logs: 'info' our lines (the summaries, a line per logged step, validation and evaluation); "
        "'debug' adds third-party detail (lm-eval's and datasets' notes, warnings and progress bars); 'warning' "
        "only warnings and errors",
    )


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
class Model:
    name: str = _f(
        "llama3",
        "model family: llama3, llama3_moe, qwen3, qwen3_moe, deepseek_v3, deepseek_v32 (DeepSeek-V3.2's sparse attention), "
        "deepseek_v4 (DeepSeek-V4), gpt_oss, qwen3_5 / qwen3_5_moe (Qwen3.5's "
        "text models), or hf (any transformers causal LM)",
    )
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
    linear_attention_kernel: Literal["auto", "torch", "fla"] = _f(
        "auto",
        "Gated DeltaNet's chunked rule (qwen3_5, qwen3_5_moe): 'torch' (ours, any device), 'fla' "
        "(flash-linear-attention's Triton kernel: CUDA, the package installed), 'auto' (fla on CUDA where installed, "
        "torch elsewhere); one log line names the one that runs",
    )
    freeze_vision: bool = _f(
        False,
        "image models (qwen3_5_vl, qwen3_5_moe_vl): train the language model and the tower's merger only, the "
        "vision tower's patch embedding, positions and blocks frozen (the common recipe; docs/vision.md)",
    )
    dsa_stage: Literal["flavor", "sparse", "dense_warmup"] = _f(
        "flavor",
        "deepseek_v32: DeepSeek-V3.2's training stage: 'sparse' (top-k attention; the model learns from the LM loss, "
        "the indexers from their KL loss), 'dense_warmup' (dense attention, only the indexers train), or 'flavor' "
        "(the flavor's own; docs/models.md, DeepSeek-V3.2)",
    )
    mtp_layers: int = _f(
        0,
        "multi-token-prediction depths after the model (deepseek_v3; DeepSeek-V3 publishes 1, its config.json's "
        "num_nextn_predict_layers): depth k predicts token i+k+1 from the previous depth's hidden state and token "
        "i+k's embedding, through one more block and the shared output head; its loss is weighed by "
        "training.mtp_loss_weight (docs/models.md, Multi-token prediction)",
        bound=Bound(ge=0),
    )
    hf_config: str = _f(
        "",
        "model.name = 'hf' with model.flavor = 'config': the transformers causal LM to build, as a local HF model "
        'folder (its config.json), a config.json path, or JSON text {"model_type": ..., fields}',
    )
    tokenizer_path: str = _f(
        "./torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken",
        "tokenizer: a tiktoken BPE file (Llama 3's tokenizer.model), or a Hugging Face tokenizer.json or its "
        "folder (Qwen3's); scripts/download_tokenizer.py fetches both kinds",
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
    mode: Literal["none", "selective", "full", "memory_budget"] = _f(
        "selective",
        "activation checkpointing mode: 'full' (every block recomputes its forward), 'selective' (selective_ac_option), "
        "'memory_budget' (torch.compile's min-cut partitioner picks what each compiled block recomputes, within "
        "memory_budget; needs training.compile)",
    )
    selective_ac_option: str = _f("2", "'N' = checkpoint every N-th block, 'op' = save selected ops' outputs")
    memory_budget: float = _f(
        0.5,
        "mode 'memory_budget': the activations each compiled block keeps, as a fraction of what the partitioner keeps "
        "for speed (1); 0 keeps the least it can, as full AC of the block (torch._functorch.config."
        "activation_memory_budget, set while the blocks compile)",
        bound=Bound(ge=0, le=1),
    )


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
    eval: Eval = field(default_factory=Eval)
    experimental: Experimental = field(default_factory=Experimental)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    float8: Float8 = field(default_factory=Float8)
    lora: Lora = field(default_factory=Lora)
    rl: Rl = field(default_factory=Rl)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
