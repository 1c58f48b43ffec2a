"""The RL step for the memory estimator (``estimation.py`` with ``rl.enable``): the RL loop's own step at its largest
shapes, on fake tensors (the estimate) or real ones (the accuracy tests' tracker run).

What a real step holds, phase by phase:

- **generation** (in process; not with ``rl.rollouts_path`` or ``rl.max_staleness``): the policy, one group at a time (``rl.group_size``
  rows), its KV cache for the longest prompt the prompts file may hold (``training.seq_len - rl.max_new_tokens``)
  plus every new token, and the sampling's temporaries over the vocabulary. Here that group is generated for all
  ``rl.max_new_tokens`` tokens (no stop id ends it early), with the run's sampling; its tokens are random.
  Generating one group is enough: the next one starts from the same memory.
- **the update**: the step's sequences on the host, then per micro-batch the policy's forward and backward with
  the log-probs over the whole vocabulary at fp32, the frozen reference's forward (``rl.kl_coef`` > 0) and the
  clipped loss; the optimizer step after each update. Here the sequences are full length (prompt + completion
  = ``training.seq_len``), as the real update pads them.

Both phases run the RL step's own code (``RLStep``: generation through ``components/generation/``, the update
through ``train_update``); only the inputs are made up. The reference's parameters are tracked with the
policy's (the report's parameter rows hold both).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torchtitan.components.generation import generate
from torchtitan.components.seams import StepResult
from torchtitan.features.rl.build import REFERENCE
from torchtitan.features.rl.rollouts import Rollout
from torchtitan.features.rl.step import RLStep

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch import nn

    from torchtitan.components.parts import CoreParts
    from torchtitan.config.manager import JobConfig

GENERATION = "generation"


class _NoPrompts:
    """The prompts file is not read: the estimate's prompts are random ids of the longest allowed length."""

    stop_ids: tuple[int, ...] = ()

    def __iter__(self):
        return iter(())


def build_no_prompts(config: JobConfig, tokenizer: Any, shard: Any, model_args: Any = None) -> _NoPrompts:
    """The estimate's ``data_loader`` slot with ``rl.enable``: nothing is read."""
    return _NoPrompts()


class EstimatedRLStep:
    """The RL step (``rl``) with made-up inputs: one group generated at full length, an update on full-length
    sequences; reads and writes nothing outside the process."""

    def __init__(self, rl: RLStep):
        self.rl = rl

    def data(self, step: int, data_iter: Iterator) -> list:
        return []  # the step builds its sequences itself, after generation (as the RL step does)

    def train(self, step: int, data: list, *, phase_done: Callable[[str], None] | None = None) -> StepResult:
        if self.rl.rl.generates_in_process():
            self._generate_longest_group()
            if phase_done is not None:
                phase_done(GENERATION)
        with unset_fake_temporarily():  # host-side lists and numbers: the real step's values are plain Python too
            batch = self.rl.update_batch(self._longest_rollouts(step))
        result, _ = self.rl.train_update(step, batch)
        return result

    def step_tokens(self) -> float:
        return self.rl.step_tokens()

    def metrics(self) -> None:
        return None

    def summary_lines(self) -> dict[str, str]:
        return self.rl.summary_lines()

    def after_commit(self, step: int, *, logged: bool) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def _prompt_len(self) -> int:
        return max(1, self.rl.config.training.seq_len - self.rl.rl.max_new_tokens)

    def _generate_longest_group(self) -> None:
        rl, core = self.rl.rl, self.rl.core
        prompt = torch.randint(0, core.tokenizer.n_words, (rl.group_size, self._prompt_len), device=core.device)
        with core.step_fn.autocast():
            generate(
                core.model_parts[0],
                prompt,
                rl.max_new_tokens,
                self.rl.sampling,
                logprobs=[],
                pad_multiple=core.parallel_dims.tp,
            )

    def _longest_rollouts(self, step: int) -> list[Rollout]:
        """The step's completions at the longest: prompt + completion = seq_len ids (padded to seq_len anyway)."""
        rl, vocab = self.rl.rl, self.rl.core.tokenizer.n_words
        p = self._prompt_len
        c = max(1, self.rl.config.training.seq_len - p)
        draw = random.Random(0)
        return [
            Rollout(
                step=step,
                group=i // rl.group_size,
                prompt_index=i // rl.group_size,
                prompt_ids=[draw.randrange(vocab) for _ in range(p)],
                completion_ids=[draw.randrange(vocab) for _ in range(c)],
                logprobs=[-1.0] * c,
                reward=float(i % 2),
            )
            for i in range(rl.prompts_per_step * rl.group_size)
        ]


def build_estimated_rl_step(
    core: CoreParts, *, modules: Mapping[str, nn.Module], start_step: int, **seams: Any
) -> EstimatedRLStep:
    """The estimate's ``step_runner`` slot with ``rl.enable``: the RL step's own code on made-up inputs."""
    return EstimatedRLStep(RLStep(core, reference=modules.get(REFERENCE), start_step=start_step, **seams))
