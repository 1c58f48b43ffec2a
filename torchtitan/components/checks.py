"""Pre-launch checks of the memory-saving options: bf16 parameters (training.dtype), bf16 optimizer states, the
chunked loss and the compiled loss (docs/parallelisms.md, "Memory-saving options"). Light: the preflight runs
them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan.config.errors import ConfigError

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims


def check_training_dtype(config: JobConfig, dims: ParallelDims) -> list[str]:
    """What cannot compose with bf16 parameters (training.dtype = "bfloat16"), before launch (LoRA:
    features/registry.py's NOT_BUILT_TOGETHER).

    Raises:
        ConfigError: a key that contradicts it (the compute dtype, stochastic rounding without bf16 weights).
        NotImplementedError: a feature not built for bf16 weights, naming it and what to set.
    """
    t, opt = config.training, config.optimizer
    if t.dtype == "float32":
        if opt.bf16_stochastic_round:
            raise ConfigError(
                "optimizer.bf16_stochastic_round = true with training.dtype = 'float32': it rounds bf16 parameters, "
                "and these are fp32; set training.dtype = 'bfloat16' (pure bf16 training) or remove the key"
            )
        return []
    key = f"training.dtype = {t.dtype!r}"
    if t.mixed_precision_param == "float32":
        raise ConfigError(
            f"{key} with training.mixed_precision_param = 'float32': the weights are bf16 and there is no fp32 copy "
            "to compute in; remove mixed_precision_param (bf16 compute) or set training.dtype = 'float32'"
        )
    if opt.fused:
        raise ConfigError(
            f"{key} with optimizer.fused = true: torch's fused Adam computes in the parameters' bf16; allowed is "
            "fused = false (the update in fp32, then rounded to the bf16 weights)"
        )
    if opt.name == "Muon" or any(rule.get("optimizer") == "Muon" for rule in opt.param_groups):
        raise NotImplementedError(
            f"{key} with Muon: its update is applied in the parameter's dtype, not built for bf16 weights; use "
            "AdamW, or training.dtype = 'float32' (optimizer.state_dtype = 'bfloat16' halves the state there)"
        )
    if config.float8.enable_float8_linear:
        raise NotImplementedError(
            f"{key} with float8.enable_float8_linear: float8 training over bf16 weights is not built or tested; "
            "set training.dtype = 'float32' for float8"
        )
    return []


def check_memory_options(config: JobConfig, dims: ParallelDims) -> list[str]:
    opt = config.optimizer
    if opt.state_dtype == "bfloat16" and opt.fused:
        raise ConfigError(
            "optimizer.fused = true with optimizer.state_dtype = 'bfloat16': torch's fused Adam kernel keeps its "
            "states in the parameter dtype; allowed with bfloat16 states is fused = false (the per-parameter "
            "fp32-math implementation), or set state_dtype = 'float32' to keep fused"
        )
    chunk = config.training.loss_chunk_size
    if chunk > 0 and config.training.compile_loss:
        raise NotImplementedError(
            f"training.compile_loss = true with training.loss_chunk_size = {chunk}: the compiled loss is the one "
            "over the full logits, and the chunked loss (its chunks recomputed in backward) is not compiled; turn "
            "one of them off"
        )
    if chunk > 0 and dims.pp_enabled:
        raise NotImplementedError(
            f"training.loss_chunk_size = {chunk} with experimental.pipeline_parallel_degree = "
            f"{dims.pp}: the pipeline schedule computes the loss from the "
            "last stage's logits; set training.loss_chunk_size = 0 under pipeline parallel"
        )
    return []
