"""Pre-launch checks of the memory-saving options: bf16 optimizer states, the chunked loss and the compiled
loss (docs/parallelisms.md, "Memory-saving options"). Light: the preflight runs them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan.config.errors import ConfigError

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims


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
