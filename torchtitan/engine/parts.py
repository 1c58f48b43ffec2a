"""A run's parts, built in one typed, ordered pass: ``build_core_parts`` (the model and its optimization) then
``build_training_parts`` (the outside world and the features' seams). Each part is built from the parts before
it through typed arguments; no half-built trainer is handed around. The pre-training loop (train.py), the
memory estimator and any later loop drive the same parts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan.build import build_step_function
from torchtitan.checkpointing.scope import WHOLE_MODEL, ModelScope
from torchtitan.components.optim.optimizer import apply_optimizer_config, build_lr_scheduler, build_optimizer
from torchtitan.components.run_control import StopSignals
from torchtitan.components.seams import (
    AfterStep,
    ClipAndStep,
    DirectPass,
    Metrics,
    NoStepHooks,
    OptimizerStep,
    OuterSync,
    SingleGroup,
    StepPass,
    Tokenizer,
)
from torchtitan.datasets.shard import DataShard
from torchtitan.distributed.backend.device import set_determinism
from torchtitan.distributed.context_parallel.context_parallel import compute_cp_positions, shard_sequence
from torchtitan.distributed.mesh import WorldMesh
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.engine.builders import Builders, Checkpointer, Guard
from torchtitan.features.documents.feed import Batch
from torchtitan.launch.run_folder import run_folder
from torchtitan.preflight.registry import Slot, enabled_builders
from torchtitan.spec import get_model_spec

if TYPE_CHECKING:
    from torchtitan.components.step import StepFunction
    from torchtitan.config.manager import JobConfig
    from torchtitan.datasets.sft.packing import PackedDocs
    from torchtitan.spec import ModelSpec, StepHooks

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class TrainingParts:
    """``CoreParts`` and what a training loop adds: checkpoints, metrics, the step's guard and the features'
    seams (each a null object where its feature is off)."""

    core: CoreParts
    outer: OuterSync
    checkpointer: Checkpointer
    start_step: int
    metrics: Metrics
    signals: StopSignals
    guard: Guard
    step_pass: StepPass
    after_step: tuple[AfterStep, ...] = field(default_factory=tuple)


def _builds(builders: Builders, config: JobConfig, slot: Slot) -> list[Callable[..., Any]]:
    """The builders of ``slot`` of every enabled feature, in the registry's order (the estimator's under
    ``builders.estimate``)."""
    return [build for _, build in enabled_builders(config, slot, estimate=builders.estimate)]


def _slot(builders: Builders, config: JobConfig, slot: Slot, default: Any, *args: Any) -> Any:
    """The one feature's part for ``slot`` (a caller's override first), or ``default`` where none is on."""
    found = _builds(builders, config, slot)
    if not found:
        return default
    assert len(found) == 1, f"two features fill the {slot} seam: {found}"
    return builders.overrides.get(slot, found[0])(*args)


def _cp_positions(config: JobConfig, dims: ParallelDims, world: WorldMesh, device: torch.device) -> torch.Tensor | None:
    if not dims.cp_enabled:
        return None
    balance = config.experimental.context_parallel_load_balance
    positions = compute_cp_positions(config.training.seq_len, dims.cp, world.local_rank("cp"), balance)
    return positions.to(device)


def build_core_parts(
    config: JobConfig, *, world_size: int, rank: int, device: torch.device, builders: Builders
) -> CoreParts:
    """The mesh, data, model parts, step function and optimizer of this rank, in that order."""
    spec = get_model_spec(config.model.name)
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world_size)
    world = WorldMesh(dims, builders.mesh(dims, device.type))
    cp_positions = _cp_positions(config, dims, world, device)
    set_determinism(config.training.seed, config.training.deterministic)
    tokenizer = builders.tokenizer(config.model)
    shard = _slot(builders, config, "data_shard", DataShard(world.local_rank("dp"), dims.dp_degree), world, config)
    model_args = builders.model_args(config, spec, tokenizer.n_words, device_type=device.type)
    data_loader = builders.data_loader(config.training, tokenizer, shard, model_args)
    whole = builders.meta_model(spec, model_args)
    num_params = sum(p.numel() for p in whole.parameters())
    num_flop_params = spec.count_flop_params(model_args, whole)
    step_fn = build_step_function(
        whole,
        lambda: builders.meta_model(spec, model_args),
        spec,
        model_args,
        config,
        world,
        device,
        eos_id=tokenizer.eos_id,
        cp_positions=cp_positions,
    )
    optimizer = build_optimizer(step_fn.model_parts, config.optimizer)
    optimizer_step = _slot(builders, config, "optimizer_step", ClipAndStep(), step_fn, optimizer, config.optimizer)
    return CoreParts(
        config=config,
        rank=rank,
        device=device,
        spec=spec,
        parallel_dims=dims,
        world=world,
        run_folder=run_folder(config),
        cp_positions=cp_positions,
        shard=shard,
        tokenizer=tokenizer,
        data_loader=data_loader,
        model_args=model_args,
        num_params=num_params,
        num_flop_params=num_flop_params,
        step_fn=step_fn,
        optimizer=optimizer,
        optimizer_step=optimizer_step,
        lr_scheduler=build_lr_scheduler(optimizer, config.training),
        hooks=step_fn.hooks if step_fn.hooks is not None else NoStepHooks(),
        model_scope=_slot(builders, config, "checkpoint_scope", WHOLE_MODEL, config),
    )


def build_training_parts(core: CoreParts, *, builders: Builders) -> TrainingParts:
    """The replica groups, the checkpointer (and the load: the step the run continues after), metrics, the
    after-step work, the guard and the step pass, in that order."""
    config = core.config
    outer = _slot(builders, config, "outer", SingleGroup(), core)
    checkpointer = builders.checkpointer(core, outer)
    start_step = builders.load(core, checkpointer)
    for after_load in _builds(builders, config, "after_load"):
        after_load(core)  # e.g. QLoRA: the loaded base as NF4
    if start_step > 0:
        changed = apply_optimizer_config(core.optimizer, core.lr_scheduler, config.optimizer, core.model_parts)
        if core.rank == 0 and changed:
            logger.info("resume: the config's optimizer settings replace the checkpoint's: %s", "; ".join(changed))
    outer.resume_at(start_step)
    metrics = builders.metrics(core, outer, start_step=start_step)
    after_step = tuple(build(core, metrics) for build in _builds(builders, config, "after_step"))
    signals = StopSignals()
    return TrainingParts(
        core=core,
        outer=outer,
        checkpointer=checkpointer,
        start_step=start_step,
        metrics=metrics,
        signals=signals,
        guard=builders.guard(core, metrics, signals),
        step_pass=_slot(builders, config, "step_pass", DirectPass(), core),
        after_step=after_step,
    )
