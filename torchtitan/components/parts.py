"""``CoreParts``: a run's model under its layout, its data and its optimization, built once by the engine
(engine/parts.py) and read by every loop over the run and by the features' builders."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan.components.batch import Batch
from torchtitan.distributed.context_parallel.context_parallel import shard_sequence

if TYPE_CHECKING:
    from torchtitan.checkpointing.scope import ModelScope
    from torchtitan.components.seams import ModelTransform, OptimizerStep, Tokenizer
    from torchtitan.components.step import StepFunction
    from torchtitan.config.manager import JobConfig
    from torchtitan.datasets.sft.packing import PackedDocs
    from torchtitan.datasets.shard import DataShard
    from torchtitan.distributed.mesh import WorldMesh
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.spec import ModelSpec, StepHooks


@dataclass(frozen=True)
class CoreParts:
    """The model under its layout, its data and its optimization: what every loop over a run needs."""

    config: JobConfig
    rank: int
    device: torch.device
    spec: ModelSpec
    parallel_dims: ParallelDims
    world: WorldMesh
    run_folder: str
    cp_positions: torch.Tensor | None
    """Context parallel: this rank's sequence positions; None without CP."""
    shard: DataShard
    tokenizer: Tokenizer
    data_loader: Iterable
    model_args: Any
    num_params: int
    num_flop_params: int
    step_fn: StepFunction
    optimizer: torch.optim.Optimizer
    optimizer_step: OptimizerStep
    lr_scheduler: Any
    hooks: StepHooks
    """The family's (and float8's) per-step hooks; ``NoStepHooks`` where there are none."""
    model_scope: ModelScope
    """The part of the model the run trains and its checkpoints hold (checkpointing/scope.py)."""
    transforms: tuple[ModelTransform, ...] = ()
    """The model transforms every model part was built with, in order (a loop's second copy of the model, RL's
    frozen reference, is built with them too)."""

    @property
    def model_parts(self) -> list[nn.Module]:
        return self.step_fn.model_parts

    def shard_batch(self, inputs: torch.Tensor, labels: torch.Tensor, packed: PackedDocs | None = None) -> Batch:
        """Under context parallel, this rank's sequence positions of the batch its dp rank reads (the
        model gets the matching positions from apply_cp's hook); block_causal: with its documents."""
        feed = self.step_fn.feed
        labels, docs = feed.prepare(inputs, labels, packed) if feed is not None else (labels, None)
        if self.cp_positions is not None:
            inputs, labels = shard_sequence([inputs, labels], seq_dim=1, positions=self.cp_positions)
        return Batch(inputs, labels, docs)

    def next_batches(self, data_iter: Iterator) -> list[Batch]:
        """One step's micro-batches (fine-tuning's with their PackedDocs), on the device, sharded for CP."""
        batches = []
        for _ in range(self.config.training.gradient_accumulation_steps):
            batches.append(self.shard_batch(*(t.to(self.device) for t in next(data_iter))))
        return batches
