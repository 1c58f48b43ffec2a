"""The optimizer step in backward (``optimizer.early_step_in_backward``): each parameter is updated as
soon as its gradient is final, and that gradient is freed at once, so the whole set of gradients
never lives at the same time.

The whole-model optimizer (``build_optimizer``) stays the owner of the state and the hyper-parameters:
the LR schedule drives its param groups, checkpoints save and load it exactly as without this mode,
so a run resumes from one mode into the other. Each parameter gets a one-parameter optimizer of the
same class whose ``state`` is the whole-model optimizer's and whose group copies the whole-model
group's values (the LR of the schedule) before each step, both looked up at every step, so a checkpoint
load, which replaces those objects, is seen; the arithmetic is the regular optimizer's, on one parameter.

When a gradient is final, i.e. when the hook steps:
- plain and TP (DTensor) parameters: autograd's post-accumulate-grad hook, after the parameter's
  backward; partial sums (SP norms) are reduced first, as the regular path does before clipping;
- FSDP2 / HSDP: FSDP calls the sharded parameter's post-accumulate-grad hooks after its
  reduce-scatter (also with CPU offload, where the gradient and the step are on the CPU);
- pipeline stages: every micro-batch's backward accumulates into the gradient (without FSDP), so
  the hook steps at the ``n_microbatches``-th call; the schedule would scale the gradients by
  1/n_microbatches after its last backward, which is after the step here, so the hook scales first.
What does not compose (clipping, gradient accumulation, DDP, split-backward pipeline schedules, the
"skip" non-finite policy) is refused before launch: features/in_backward/checks.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torchtitan.components.group_seams import GradientSync
    from torchtitan.components.step import StepFunction
    from torchtitan.config.schema import Optimizer as OptimizerConfig

from torchtitan.components.optim.optimizer import optimizer_over
from torchtitan.distributed.grad_norm import GradNormAccumulator, reduce_partial_grads_

logger = logging.getLogger(__name__)


class OptimizerInBackward:
    """Steps every parameter of ``optimizer`` from a hook on its gradient; ``finish_step`` closes a step.

    Args:
        optimizer: the whole-model optimizer (state, param groups); its ``step`` is never called.
        build_one: builds an optimizer of the same kind over a list of parameters.
        grads_per_step: how many accumulations make a gradient final (pipeline micro-batches without FSDP).
        grad_divisor: what the gradient is divided by before the step (pipeline micro-batches).
        norm_groups: process groups whose ranks hold different parameters (pipeline), for the norm.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        build_one: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        *,
        grads_per_step: int = 1,
        grad_divisor: int = 1,
        norm_groups: Iterable[dist.ProcessGroup] = (),
    ):
        self.optimizer = optimizer
        self.grads_per_step, self.grad_divisor = grads_per_step, grad_divisor
        self.norm_groups = list(norm_groups)
        self.norm = GradNormAccumulator()
        self.calls: dict[nn.Parameter, int] = {}
        # parameter -> (its one-parameter optimizer, the index of its group in ``optimizer``)
        self.one: dict[nn.Parameter, tuple[torch.optim.Optimizer, int]] = {}
        self.handles = []
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                self.one[p] = (build_one([p]), index)
                self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    @torch.no_grad()
    def _on_grad(self, p: nn.Parameter) -> None:
        calls = self.calls[p] = self.calls.get(p, 0) + 1
        if calls < self.grads_per_step:
            return
        reduce_partial_grads_([p])
        if self.grad_divisor != 1:
            p.grad.div_(self.grad_divisor)
        self.norm.add(p.grad)
        one, index = self.one[p]
        # Looked up now: loading a checkpoint replaces the whole-model optimizer's state and group objects.
        one.state = self.optimizer.state
        one.param_groups[0].update({k: v for k, v in self.optimizer.param_groups[index].items() if k != "params"})
        one.step()
        p.grad = None

    def finish_step(self) -> torch.Tensor:
        """After the step's backward: check every gradient was used, and return the global grad norm."""
        unfinished = [n for p, n in self.calls.items() if n != self.grads_per_step]
        leftover = sum(1 for p in self.one if p.grad is not None)
        self.calls = {}
        if unfinished or leftover:
            raise RuntimeError(
                f"optimizer step in backward: {len(unfinished)} parameters got an unexpected number of gradient "
                f"accumulations (expected {self.grads_per_step}) and {leftover} kept a gradient no hook stepped; "
                "this layout delivers gradients in a way the in-backward step does not handle"
            )
        # The LR scheduler warns when the optimizer it drives never steps; here the steps are the hooks'.
        self.optimizer._opt_called = True
        return self.norm.finish(self.norm_groups)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class InBackwardStep:
    """The ``optimizer_step`` seam with ``optimizer.early_step_in_backward``: the norm is the hooks' (nothing left
    to clip), and a kept step has nothing left to apply."""

    steps_in_backward = True

    def __init__(self, in_backward: OptimizerInBackward):
        self.in_backward = in_backward

    def grad_norm(self, clip: Callable[[list | None], torch.Tensor], params: list | None) -> torch.Tensor:
        return self.in_backward.finish_step()

    def apply(self, optimizer: torch.optim.Optimizer, gradients: GradientSync) -> None:
        pass  # every parameter already stepped during backward

    def stepping(self, optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
        """The one-parameter optimizers the hooks step."""
        return [one for one, _ in self.in_backward.one.values()]


def build_optimizer_in_backward(
    optimizer: torch.optim.Optimizer,
    config: OptimizerConfig,
    *,
    pipeline_microbatches: int,
    fsdp: bool,
    pp_group: dist.ProcessGroup | None,
) -> OptimizerInBackward:
    """The per-parameter steps in backward over ``optimizer``'s parameters (``optimizer.early_step_in_backward``).

    ``pipeline_microbatches``: 1 without pipeline parallel. Without FSDP every micro-batch's backward accumulates
    into a stage's gradients; FSDP's hook fires once, after its reduce-scatter.
    """
    in_backward = OptimizerInBackward(
        optimizer,
        lambda params: optimizer_over(params, config),
        grads_per_step=1 if fsdp else pipeline_microbatches,
        grad_divisor=pipeline_microbatches,
        norm_groups=[pp_group] if pp_group is not None else [],
    )
    logger.info(
        "optimizer steps in backward: each of this rank's %d parameters is stepped by a hook as soon as its "
        "gradient is final, and the gradient freed",
        len(in_backward.one),
    )
    return in_backward


def build_in_backward_step(
    step_fn: StepFunction, optimizer: torch.optim.Optimizer, config: OptimizerConfig
) -> InBackwardStep:
    """The ``optimizer_step`` seam's builder (features/registry.py): hooks over ``step_fn``'s model parts.

    Under pipeline parallel a stage's backward runs once per micro-batch (FSDP reduces after the last one) and the
    schedule would scale the gradients by 1/micro-batches after it; the grad norm is summed over the pp axis too, as
    in ``StepFunction.clip_grad_norm_``.
    """
    in_backward = build_optimizer_in_backward(
        optimizer,
        config,
        pipeline_microbatches=step_fn.pipeline.n_microbatches if step_fn.pipeline is not None else 1,
        fsdp=step_fn.world.dims.fsdp_enabled,
        pp_group=step_fn.world.group("pp"),
    )
    return InBackwardStep(in_backward)
