"""The ``[training]`` section of the typed config tree (config/schema.py re-exports it): its own module so that
schema.py stays under the house file-size limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtitan.config.bounds import Bound
from torchtitan.config.fields import POSITIVE as _POSITIVE
from torchtitan.config.fields import config_field as _f

# The names of torchtitan/datasets/registry.py's DATASETS (tests/unit/test_data_errors.py keeps them equal),
# spelled out here so that the config check knows them without importing the data stack.
DatasetName = Literal[
    "pydocs",
    "pydocs_val",
    "c4",
    "c4_test",
    "c4_validation",
    "fineweb",
    "sft_arith",
    "sft_arith_val",
    "vlm_shapes",
    "vlm_shapes_val",
]


@dataclass
class Training:
    dataset: DatasetName = _f(
        "pydocs",
        "dataset name: pydocs (shipped, offline), c4, c4_test, fineweb; sft_arith (shipped chat rows, for "
        "dataset_format = 'chat')",
    )
    dataset_path: str | None = _f(
        None,
        "local file/folder (or hub id; fine-tuning: a dataset in the local HF cache) to read the dataset from; an "
        "indexed dataset (PREFIX, PREFIX.bin/.idx or a folder of them, scripts/tokenize_data.py) is read window by window",
    )
    dataset_mix: list[str] | None = _f(
        None,
        "weighted blend of pre-training sources, ['PATH_OR_NAME:WEIGHT', ...] (an indexed PREFIX or folder, a local "
        "text file/folder or a registered name; weights normalised; Megatron's blending rule), instead of "
        "dataset/dataset_path (docs/data.md)",
    )
    dataset_mix_restart: bool = _f(
        False, "on resume with another dataset_mix than the checkpoint's: restart the mix there instead of refusing"
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
        "the learning-rate schedule (components/optim/lr_schedule.py): 'linear' = warmup (step+1)/(warmup_steps+1), then "
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
        "all-gathers, more memory); default = always except the last block and the root (embedding, norm, output)",
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
    mtp_loss_weight: float = _f(
        0.3,
        "with model.mtp_layers = D: the multi-token-prediction loss's weight, DeepSeek-V3's lambda (0.3 for its "
        "first 10T tokens, then 0.1): the loss trained is the model's plus lambda / D times each depth's; 0 trains "
        "exactly as without MTP (the depths then learn nothing). The logged loss is the model's; mtp_loss each depth's",
        bound=Bound(ge=0),
    )
    dtype: Literal["float32", "bfloat16"] = _f(
        "float32",
        "dtype of parameters, gradients and optimizer states. bfloat16 = pure bf16 training: no fp32 copy of the "
        "weights (half the bytes of each; RoPE, the norms' statistics, the loss and the optimizer's arithmetic stay "
        "fp32; initial weights are the fp32 ones rounded). float32 = fp32 weights, computed in mixed_precision_param",
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
    cuda_graphs: bool = _f(
        False,
        "with compile on CUDA: each compiled dense block's kernels are recorded as CUDA graphs and replayed every step "
        "(torch.compile mode 'reduce-overhead': no per-kernel launch from the host; more memory, the graphs' pool). "
        "Built for one process or DDP; refused off CUDA, without compile, for MoE families and model.name 'hf', with "
        "FSDP, TP, CP, PP, gradient accumulation or activation_checkpoint.mode 'memory_budget' (docs/parallelisms.md, "
        "Compile)",
    )
    gc_freq: int = _f(
        50, "run Python garbage collection every N steps (automatic GC is off while training)", bound=_POSITIVE
    )
    cpu_malloc: Literal["auto", "tuned", "system"] = _f(
        "auto",
        "glibc malloc for a step's host tensors: tuned = blocks up to 32 MiB from the heap and its free top kept up to "
        "1 GiB, so each step reuses the last one's pages instead of faulting them in again (+6% tokens/s on CPU at "
        "one process with 2 threads; losses unchanged; refused without glibc); system = glibc's defaults; auto = "
        "tuned on a CPU device with more than one compute thread per process and glibc, unless MALLOC_*_, "
        "GLIBC_TUNABLES or an LD_PRELOADed allocator sets malloc up already",
    )
    seed: int | None = _f(None, "seed for weights init; None = 0. Weights depend only on it, not on the layout")
    deterministic: bool = _f(False, "use deterministic algorithms (slower)")
    on_nonfinite: Literal["stop", "skip"] = _f(
        "stop",
        "a step whose loss or grad norm is NaN/inf (checked on every rank before the optimizer step): stop "
        "(exit 4 naming the step; the last good checkpoint is kept) or skip (drop its update)",
    )
    moe_aux_loss_scope: Literal["global_micro_batch", "local_micro_batch"] = _f(
        "global_micro_batch",
        "MoE switch aux loss (flavors with load_balance = 'aux_loss'): its tokens per expert and mean router "
        "probabilities over every rank's tokens of the micro-batch (global_micro_batch: one small all-reduce per MoE "
        "layer; the same loss under every layout, equal to one process) or over each rank's own tokens "
        "(local_micro_batch: a per-rank regulariser, as transformers computes it; layouts then train differently). "
        "With gradient accumulation each micro-batch is balanced on its own, so the loss then depends on the dp "
        "degree too (docs/moe.md)",
    )
    replay_every_n_steps: int = _f(
        0,
        "step replay, a check against silent data corruption: every N steps each rank trains the step twice from the "
        "same inputs and weights and compares its loss and gradients bit for bit (costs one more forward + backward "
        "per N steps; needs deterministic = true; not with pipeline parallel, early_step_in_backward or fault "
        "tolerance); 0 = off (docs/reliability.md)",
        bound=Bound(ge=0, text=">= 0 (0 turns step replay off)"),
    )
    on_replay_mismatch: Literal["stop", "warn"] = _f(
        "stop",
        "a replayed step that differs (one line naming the rank, host, step and tensor): stop (exit 6 before the "
        "optimizer step; the last checkpoint is kept) or warn (log it and go on with the replay's gradients)",
    )
    max_nonfinite_skips: int = _f(
        3, "with on_nonfinite = 'skip': stop after this many skipped steps in a row", bound=_POSITIVE
    )
