"""Validation loss on held-out data, the same number under every parallel layout.

Every validation reads the same batches (the loader is rewound to its initial state), laid out
like training data: global batch k holds the same samples whatever the data-parallel degree, so
the global mean loss equals the single-process one. The model runs in eval mode without grad.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.build import cross_entropy_loss
from torchtitan.datasets import build_hf_data_loader, compute_stream_groups

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.datasets import Tokenizer


class Validator:
    def __init__(
        self,
        config: JobConfig,
        tokenizer: Tokenizer,
        *,
        dp_rank: int,
        dp_degree: int,
        device: torch.device,
        loss_context: Callable[[], contextlib.AbstractContextManager],
        loss_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None,
        pipeline=None,
        shard_batch: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ):
        v = config.validation
        # Default: one training step's worth of samples per rank, so the global validation batch
        # (and so the number) does not depend on how training splits its batch into micro-batches.
        batch_size = v.batch_size or config.training.batch_size * config.training.gradient_accumulation_steps
        groups = compute_stream_groups(dp_rank, dp_degree, batch_size, 1)
        self.loader = build_hf_data_loader(
            v.dataset, v.dataset_path, tokenizer, config.training.seq_len, groups, dp_degree * batch_size
        )
        self.initial_state = self.loader.state_dict()
        self.steps = v.steps
        self.device = device
        self.loss_context = loss_context
        self.loss_group = loss_group
        self.pp_group = pp_group
        self.pipeline = pipeline
        self.shard_batch = shard_batch or (lambda inputs, labels: (inputs, labels))  # context parallel's slice

    def _batch_loss(self, model_parts: list[nn.Module], inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self.loss_context():
            if self.pipeline is None:
                loss = cross_entropy_loss(model_parts[0](inputs), labels)
            else:
                losses: list[torch.Tensor] = []
                kwargs = {"target": labels, "losses": losses} if self.pipeline.has_last_stage else {}
                args = (inputs,) if self.pipeline.has_first_stage else ()
                self.pipeline.schedule.eval(*args, **kwargs)
                loss = torch.stack([x.detach() for x in losses]).mean() if losses else torch.zeros((), device=self.device)
        loss = loss.detach()
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    @torch.no_grad()
    def run(self, model_parts: list[nn.Module]) -> dict[str, float]:
        """Mean loss over ``steps`` global batches (and its perplexity); every rank gets the same numbers."""
        self.loader.load_state_dict(self.initial_state)
        data = iter(self.loader)
        for part in model_parts:
            part.eval()
        total = torch.zeros((), device=self.device)
        for _ in range(self.steps):
            inputs, labels = next(data)
            inputs, labels = self.shard_batch(inputs.to(self.device), labels.to(self.device))
            total += self._batch_loss(model_parts, inputs, labels).float()
        for part in model_parts:
            part.train()
        if self.pp_group is not None:  # only the last stage holds the loss
            dist.all_reduce(total, group=self.pp_group)
        if self.loss_group is not None:
            dist.all_reduce(total, group=self.loss_group)
            total /= dist.get_world_size(self.loss_group)
        loss = total.item() / self.steps
        return {"validation_loss": loss, "validation_perplexity": math.exp(min(loss, 700.0))}
