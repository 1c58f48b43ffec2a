"""The RL step for the memory estimator (``estimation.py`` with ``rl.enable``): the RL loop's own step at its largest
shapes, on fake tensors (the estimate) or real ones (the accuracy tests' tracker run).

What a real step holds, phase by phase:

- **generation** (in process; not with ``rl.rollouts_path``): the policy, one group at a time (``rl.group_size``
  rows), its KV cache for the longest prompt the prompts file may hold (``training.seq_len - rl.max_new_tokens``)
  plus every new token, and the sampling's temporaries over the vocabulary. Here that group is generated for all
  ``rl.max_new_tokens`` tokens (no stop id ends it early), with the run's sampling; its tokens are random.
  Generating one group is enough: the next one starts from the same memory.
- **the update**: the step's sequences on the host, then per micro-batch the policy's forward and backward with
  the log-probs over the whole vocabulary at fp32, the frozen reference's forward (``rl.kl_coef`` > 0) and the
  clipped loss; the optimizer step after each update. Here the sequences are full length (prompt + completion
  = ``training.seq_len``), as the real update pads them.

Both phases run the RL trainer's own code (``RLTrainer``: generation through ``components/generation.py``, the
update through ``_train_update``); only the inputs are made up. The reference's parameters are tracked with the
policy's (the report's parameter rows hold both).
"""

from __future__ import annotations

import random

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torchtitan.components.generation import generate
from torchtitan.rl.rollouts import Rollout
from torchtitan.train import StepResult
from torchtitan.train_rl import RLTrainer

GENERATION = "generation"


class _NoPrompts:
    """The prompts file is not read: the estimate's prompts are random ids of the longest allowed length."""

    stop_ids: tuple[int, ...] = ()

    def __iter__(self):
        return iter(())


class EstimatedRLTrainer(RLTrainer):
    """``RLTrainer`` whose step generates one group at full length and updates on full-length sequences."""

    def _prompt_source(self, training, tokenizer, shard, model_args=None) -> _NoPrompts:
        return _NoPrompts()

    def _open_outside(self) -> None:
        """No reward function, rollouts file or published policy: the estimate reads and writes nothing."""

    def next_batches(self, data_iter) -> list:
        return []  # the step builds its sequences itself, after generation (as the RL step does)

    def train_step(self, batches: list) -> StepResult:
        if not self.rl.rollouts_path:
            self._generate_longest_group()
            self.phase_done(GENERATION)
        with unset_fake_temporarily():  # host-side lists and numbers: the real step's values are plain Python too
            batch = self._update_batch(self._longest_rollouts())
        result, _ = self._train_update(batch)
        return result

    @property
    def _prompt_len(self) -> int:
        return max(1, self.config.training.seq_len - self.rl.max_new_tokens)

    def _generate_longest_group(self) -> None:
        rl, vocab = self.rl, self.core.tokenizer.n_words
        prompt = torch.randint(0, vocab, (rl.group_size, self._prompt_len), device=self.device)
        with self.core.step_fn.autocast():
            generate(
                self.model_parts[0],
                prompt,
                rl.max_new_tokens,
                self.sampling,
                logprobs=[],
                pad_multiple=self.parallel_dims.tp,
            )

    def _longest_rollouts(self) -> list[Rollout]:
        """The step's completions at the longest: prompt + completion = seq_len ids (padded to seq_len anyway)."""
        rl, vocab = self.rl, self.core.tokenizer.n_words
        p = self._prompt_len
        c = max(1, self.config.training.seq_len - p)
        draw = random.Random(0)
        return [
            Rollout(
                step=self.step,
                group=i // rl.group_size,
                prompt_index=i // rl.group_size,
                prompt_ids=[draw.randrange(vocab) for _ in range(p)],
                completion_ids=[draw.randrange(vocab) for _ in range(c)],
                logprobs=[-1.0] * c,
                reward=float(i % 2),
            )
            for i in range(rl.prompts_per_step * rl.group_size)
        ]
