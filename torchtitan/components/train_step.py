"""The pre-training step: what one step does when no feature replaces it (the ``StepRunner`` seam,
components/seams.py; RL's generate-and-update is the other). The loop (train.py) drives it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torchtitan.components.seams import StepResult

if TYPE_CHECKING:
    from torchtitan.components.batch import Batch
    from torchtitan.components.group_seams import GradientSync, StepAgreement
    from torchtitan.components.parts import CoreParts
    from torchtitan.components.run_control import Guard
    from torchtitan.components.seams import StepPass


def is_log_step(config: Any, step: int, start_step: int) -> bool:
    """Whether ``step`` logs its record: the run's first, every ``metrics.log_freq``-th and the last."""
    first = step == start_step + 1
    return first or step % config.metrics.log_freq == 0 or step == config.training.steps


class PretrainStep:
    """The step's micro-batches, each forward/backward (through the step pass), the gradients reduced across the
    replica groups, clipped, the guard's verdict, the groups' commit, then the update (or none)."""

    def __init__(
        self,
        core: CoreParts,
        *,
        agreement: StepAgreement,
        gradients: GradientSync,
        guard: Guard,
        step_pass: StepPass,
        start_step: int,
    ):
        self.core, self.agreement, self.gradients = core, agreement, gradients
        self.guard, self.step_pass, self.start_step = guard, step_pass, start_step

    def data(self, step: int, data_iter: Iterator) -> list[Batch]:
        return self.core.next_batches(data_iter)

    def train(self, step: int, batches: list[Batch], *, phase_done: Callable[[str], None] | None = None) -> StepResult:
        """Forward/backward every micro-batch, clip, step (with replica groups: average over them, step only if
        they commit). Where this rank does not hold the loss, its share is 0 (``StepFunction.reduce_loss``)."""
        core, gradients = self.core, self.gradients
        step_fn, hooks = core.step_fn, core.hooks
        # block_causal: every counted token (of every replica group) weighs the same
        token_weight = step_fn.count_tokens(batches, outer_sum=gradients.outer_sum)
        loss_sum = self.step_pass.run(step, step_fn.train_micro_batches, batches, token_weight=token_weight)
        loss_sum, params = gradients.reduce_gradients(step_fn.finish_gradients, loss_sum)
        max_norm = core.config.training.max_norm
        grad_norm = core.optimizer_step.grad_norm(lambda ps: step_fn.clip_grad_norm_(max_norm, ps), params)
        hooks.reduce_step(keep_metrics=is_log_step(core.config, step, self.start_step), outer_sum=gradients.outer_sum)
        verdict = self.guard.check(step, loss_sum, grad_norm)  # every rank: same verdict
        committed = self.agreement.commit(step)
        if verdict.skip or not committed:  # no update; the schedule still follows the committed step count
            hooks.discard_step()
        else:
            core.optimizer_step.apply(core.optimizer, gradients)
            hooks.after_optimizer_step()
        if committed:
            core.lr_scheduler.step()
        core.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum, grad_norm, committed, stop=verdict.stop)

    def step_tokens(self) -> float:
        """This rank's share of the step's tokens: TP, CP and PP ranks split the work on the same samples, so
        tokens/s and MFU are per-rank numbers that add up across the world."""
        t, dims = self.core.config.training, self.core.parallel_dims
        return t.batch_size * t.gradient_accumulation_steps * t.seq_len / (dims.tp * dims.cp * dims.pp)

    def metrics(self) -> None:
        return None

    def summary_lines(self) -> dict[str, str]:
        return {}

    def after_commit(self, step: int, *, logged: bool) -> None:
        pass

    def close(self) -> None:
        pass
