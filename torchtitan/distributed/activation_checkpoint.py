"""Activation checkpointing of transformer blocks: full, every N-th block, selective by op, or by memory budget."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.config.errors import ConfigError
from torchtitan.config.schema import ActivationCheckpoint

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

# Ops whose outputs are expensive to recompute and cheap to keep: attention (every backend's
# variant, the CPU one included) and reductions; matmuls are handled separately below.
_SAVE_OPS = {
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


# Profiler annotations are not computation: SAC must not count them. FSDP2 opens record_function
# scopes in its hooks, and an FSDP unit inside a checkpointed block (the experts under expert
# parallel) runs them a different number of times in forward and in recompute, so torch 2.13's
# per-op replay counters miss ("profiler._record_function_enter_new ... invocation index 3 ... not
# found in storage": torchtitan#3427; upstream fix pytorch#196862 ignores them the same way).
# SAC_IGNORED_OPS is the public set torch's SAC modes consult; adding to it changes nothing else.
_PROFILER_OPS = {
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


def _op_policy():
    """Save attention outputs and every other matmul; recompute the rest (cheap elementwise ops)."""
    mm_count: dict[str, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if op == torch.ops.aten.mm.default:
            mm_count[mode] += 1
            # Keep the first of each pair of matmuls: halves the matmul recompute for half the memory.
            return CheckpointPolicy.MUST_SAVE if mm_count[mode] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def wrap_block(block: nn.Module, *, op_selective: bool) -> nn.Module:
    """``block`` under activation checkpointing: full recompute, or the op policy's selective one."""
    if op_selective:
        return checkpoint_wrapper(
            block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=_op_policy, preserve_rng_state=False
        )
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)


def apply_ac(
    model: nn.Module, config: ActivationCheckpoint, blocks: nn.ModuleDict | nn.ModuleList | None = None
) -> None:
    """Wrap blocks of ``blocks`` (default ``model.layers``; a transformers model's decoder layers) in place. ``mode``
    none is a no-op.

    full: every block recomputes its forward in backward. selective 'N': every N-th block does.
    selective 'op': every block keeps only the outputs of the ops in the save policy. memory_budget: no wrapper;
    compile's partitioner chooses within each compiled block (``compile_backend``).
    """
    if config.mode in ("none", "memory_budget"):
        return
    op_selective = config.mode == "selective" and config.selective_ac_option == "op"
    if op_selective:
        torch.utils.checkpoint.SAC_IGNORED_OPS.update(_PROFILER_OPS)  # once, not in every block's forward
    every = int(config.selective_ac_option) if config.mode == "selective" and not op_selective else 1
    blocks = model.layers if blocks is None else blocks
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else range(len(blocks))
    for i, key in enumerate(keys):
        if i % every == 0:
            blocks[key] = wrap_block(blocks[key], op_selective=op_selective)


def compile_backend(config: ActivationCheckpoint) -> str | Callable:
    """torch.compile's backend for the blocks: inductor; with mode 'memory_budget', inductor under the budget.

    The min-cut partitioner reads ``torch._functorch.config.activation_memory_budget`` when it splits a block's joint
    graph into forward and backward, which happens inside inductor's compile of the block (its first call, and any
    recompile). The budget is set for that compile only (``config.patch``): nothing else compiled in the process
    (the loss, flex attention, another model) sees it.
    """
    if config.mode != "memory_budget":
        return "inductor"
    budget = config.memory_budget

    def inductor_within_budget(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        # inductor's entry read at each compile, as torch's "inductor" backend reads it: the memory estimator runs
        # the partitioned graphs op by op instead (estimation/fake_trainer.py, compile_patches)
        from torch._inductor import compile_fx

        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compile_fx.compile_fx(gm, example_inputs)

    return inductor_within_budget


def check_activation_checkpoint(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Pre-launch: ``selective_ac_option`` is 'op' or a positive integer N (checkpoint every N-th block); mode
    'memory_budget' compiles (its partitioner is compile's); a budget set for another mode is said to do nothing."""
    ac = config.activation_checkpoint
    if ac.mode == "memory_budget" and not config.training.compile:
        raise ConfigError(
            "activation_checkpoint.mode = 'memory_budget' needs training.compile = true (torch.compile's partitioner "
            "chooses what each block recomputes); turn compile on, or use mode 'full' or 'selective'"
        )
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        if not ac.selective_ac_option.isdigit() or int(ac.selective_ac_option) < 1:
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option = {ac.selective_ac_option!r}: "
                "allowed are 'op' or a positive integer N (checkpoint every N-th block)"
            )
    if ac.mode != "memory_budget" and ac.memory_budget != ActivationCheckpoint.memory_budget:
        return [
            f"activation_checkpoint.memory_budget = {ac.memory_budget} has no effect with mode = {ac.mode!r} "
            "(it acts with mode = 'memory_budget')"
        ]
    return []
