"""Validation loss on held-out data, the same number under every parallel layout.

Every validation reads the same batches (the loader is rewound to its initial state), laid out
like training data: global batch k holds the same samples whatever the data-parallel degree, so
the global mean loss equals the single-process one. The model runs in eval mode without grad.

Under fault tolerance each replica group evaluates the whole global batch itself (its ranks read it
as ``microbatches`` = group_size pieces each), so every group reports HSDP's number without a
collective between the groups, which a group that just failed to commit would not pair.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchtitan.components.batch import Batch

if TYPE_CHECKING:
    from torchtitan.components.parts import CoreParts
    from torchtitan.components.seams import Metrics
    from torchtitan.components.step import StepFunction
    from torchtitan.config.schema import Training, Validation
    from torchtitan.datasets.shard import DataShard
    from torchtitan.datasets.tokenizer import Tokenizer


class Validator:
    """Evaluates through the trainer's own ``StepFunction`` (same autocast, loss context, layouts)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        validation: Validation,
        training: Training,
        shard: DataShard,
        step_fn: StepFunction,
        shard_batch: Callable[..., Batch] = Batch,
        microbatches: int = 1,
        model_args: Any = None,
    ):
        """``shard``: the data-parallel rank and degree this validation reads by; ``microbatches``: pieces
        of ``validation.batch_size`` samples each rank reads per batch (the global batch has ``shard.degree
        * microbatches`` of them). ``shard_batch``: a device batch -> this rank's ``Batch`` (the trainer's:
        context parallel's slice, block_causal's documents); default the batch as it is."""
        # Default: one training step's worth of samples per rank, so the global validation batch
        # (and so the number) does not depend on how training splits its batch into micro-batches.
        batch_size = validation.batch_size or training.batch_size * training.gradient_accumulation_steps
        # lazy, as in build.build_data_loader: the trainer imports without the data stack
        from torchtitan.datasets.hf_datasets import compute_stream_groups
        from torchtitan.datasets.text_loader import build_text_data_loader

        groups = compute_stream_groups(shard.rank, shard.degree, batch_size, microbatches)
        num_streams = shard.degree * batch_size * microbatches
        if training.dataset_format != "text":  # fine-tuning: the held-out rows packed alike, so the loss is masked
            from torchtitan.datasets.sft.finetune import build_sft_data_loader

            self.loader = build_sft_data_loader(
                validation.dataset, validation.dataset_path, tokenizer, training, groups, num_streams, model_args
            )
        else:
            self.loader = build_text_data_loader(
                validation.dataset, validation.dataset_path, tokenizer, training.seq_len, groups, num_streams
            )
        self.initial_state = self.loader.state_dict()
        self.steps, self.microbatches = validation.steps, microbatches
        self.step_fn = step_fn
        self.shard_batch = shard_batch

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        """Mean token loss over ``steps`` global batches (and its perplexity, and the tokens it counted); every
        rank gets the same numbers.

        Each token counts alike over the whole set (the summed loss over the counted tokens of every step), not
        each step: fine-tuning's steps hold very different numbers of trained tokens, and a mean of step means
        would not be the loss over the held-out set.
        """
        self.loader.load_state_dict(self.initial_state)
        data = iter(self.loader)
        parts, device = self.step_fn.model_parts, self.step_fn.device
        for part in parts:
            part.eval()
        loss_sum = torch.zeros((), device=device)
        counted = torch.zeros((), device=device, dtype=torch.long)
        for _ in range(self.steps):
            for _ in range(self.microbatches):
                batch = self.shard_batch(*(t.to(device) for t in next(data)))  # fine-tuning's with its PackedDocs
                batch_loss, batch_counted = self.step_fn.forward_loss_sum(batch)
                loss_sum += batch_loss
                counted += batch_counted
        for part in parts:
            part.train()
        total, tokens = self.step_fn.reduce_sums(loss_sum, counted)
        # divided in the loss's precision, as a mean reduction divides: one batch's number is its training loss exactly
        loss = (torch.tensor(total, dtype=torch.float32) / max(tokens, 1)).item()
        return {
            "validation_loss": loss,
            "validation_perplexity": math.exp(min(loss, 700.0)),
            "validation_tokens": tokens,
        }


class PeriodicValidation:
    """The ``after_step`` seam of ``validation.enabled``: the validator every ``validation.freq`` steps and at the
    last step, its record logged through the run's metrics."""

    def __init__(self, validator: Validator, *, freq: int, last_step: int, log: Callable[[int, dict], None]):
        self.validator, self.freq, self.last_step, self.log = validator, freq, last_step, log

    def maybe_run(self, step: int) -> None:
        if step % self.freq == 0 or step == self.last_step:
            self.log(step, self.validator.run())


def build_validation(core: CoreParts, metrics: Metrics) -> PeriodicValidation:
    """The ``after_step`` seam's builder (features/registry.py)."""
    from torchtitan.datasets.shard import DataShard

    cfg = core.config
    # Each data-parallel group of ranks evaluates the whole global batch: with several replica groups reading one
    # global batch (core.shard spans them), each group reads its ranks' part of every group's share.
    shard = DataShard(core.world.local_rank("dp"), core.parallel_dims.dp_degree)
    microbatches = core.shard.degree // shard.degree
    validator = Validator(
        core.tokenizer,
        validation=cfg.validation,
        training=cfg.training,
        shard=shard,
        step_fn=core.step_fn,
        shard_batch=core.shard_batch,
        microbatches=microbatches,
        model_args=core.model_args,
    )
    return PeriodicValidation(
        validator, freq=cfg.validation.freq, last_step=cfg.training.steps, log=metrics.log_validation
    )
