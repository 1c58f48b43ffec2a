"""Pre-launch: what cannot compose with ``optimizer.early_step_in_backward`` (light: the preflight runs it;
the step itself is features/in_backward/in_backward.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan.distributed.pipeline.layout import splits_backward

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

_KEY = "optimizer.early_step_in_backward = true"


def check_in_backward(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Before launch: what cannot compose with stepping each parameter during backward.

    Raises:
        NotImplementedError: naming the conflicting key, why, and what to set.
    """
    if not config.optimizer.early_step_in_backward:
        return []
    t, exp = config.training, config.experimental
    opt = config.optimizer
    if opt.name == "Muon" or any(rule.get("optimizer") == "Muon" for rule in opt.param_groups):
        raise NotImplementedError(
            f"{_KEY} with Muon (optimizer.name or a param_groups rule): Muon orthogonalises whole matrices, which "
            "needs every shard's gradient at once, not one parameter's as its hook fires; use AdamW or turn the "
            "in-backward step off"
        )
    ck = config.checkpoint
    if ck.enable_checkpoint and ck.async_mode == "async_with_pinned_mem":
        raise NotImplementedError(
            f"{_KEY} with checkpoint.async_mode = 'async_with_pinned_mem': each parameter steps during backward, "
            "while the checkpoint's background copy (waited for before the optimizer step, which this mode never "
            "calls) may still read it; use async_mode = 'async'"
        )
    if t.max_norm > 0:
        raise NotImplementedError(
            f"{_KEY} with training.max_norm = {t.max_norm}: clipping needs the total gradient norm before any "
            "parameter steps, and here each parameter steps as soon as its own gradient is ready; set "
            "training.max_norm = 0 (no clipping; the norm is still logged) or turn the in-backward step off"
        )
    if t.gradient_accumulation_steps > 1:
        raise NotImplementedError(
            f"{_KEY} with training.gradient_accumulation_steps = {t.gradient_accumulation_steps}: each backward "
            "would step on one micro-batch's gradient; set gradient_accumulation_steps = 1 (a larger "
            "training.batch_size gives the same global batch) or turn the in-backward step off"
        )
    if t.on_nonfinite == "skip":
        raise NotImplementedError(
            f"{_KEY} with training.on_nonfinite = 'skip': the update is applied during backward, before the "
            "step's loss and grad norm are known, so a non-finite step cannot be dropped; set "
            "training.on_nonfinite = 'stop' (the last good checkpoint is kept)"
        )
    if dims.dp_replicate_enabled and not dims.fsdp_enabled:
        raise NotImplementedError(
            f"{_KEY} with DDP (data_parallel_replicate_degree = {dims.dp_replicate}, data_parallel_shard_degree "
            "= 1): DDP all-reduces gradient buckets after autograd hands the gradient over, so a hook would step "
            "on this rank's unreduced gradient; use FSDP (data_parallel_shard_degree > 1) or HSDP instead"
        )
    if dims.pp_enabled and splits_backward(exp.pipeline_parallel_schedule, exp.pipeline_parallel_schedule_csv):
        raise NotImplementedError(
            f"{_KEY} with experimental.pipeline_parallel_schedule = {exp.pipeline_parallel_schedule!r}"
            f"{' (its CSV has I/W actions)' if exp.pipeline_parallel_schedule_csv else ''}: zero-bubble schedules "
            "compute weight gradients separately and assign them outside autograd, where no hook sees them; "
            "use 1F1B, GPipe, Interleaved1F1B or LoopedBFS"
        )
    return []
