"""A run's parts, built in one typed, ordered pass: ``build_core_parts`` (the model and its optimization) then
``build_training_parts`` (the outside world and the features' seams). Each part is built from the parts before
it through typed arguments; no half-built trainer is handed around. The loop (train.py), the memory estimator and
any tool drive the same parts; what one step does is the ``runner`` (pre-training's, or a feature's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan.build import build_step_function, model_features
from torchtitan.checkpointing.scope import WHOLE_MODEL
from torchtitan.components.group_seams import (
    CheckpointShare,
    GradientSync,
    LocalGradients,
    NoFields,
    OneGroup,
    OwnCheckpoints,
    StepAgreement,
    StepFields,
    StopAnytime,
    StopPolicy,
)
from torchtitan.components.optim.optimizer import apply_optimizer_config, build_lr_scheduler, build_optimizer
from torchtitan.components.parts import CoreParts
from torchtitan.components.run_control import StopSignals
from torchtitan.components.seams import AfterStep, ClipAndStep, DirectPass, Metrics, NoStepHooks, StepPass, StepRunner
from torchtitan.components.train_step import PretrainStep
from torchtitan.datasets.shard import DataShard
from torchtitan.distributed.backend.device import set_determinism
from torchtitan.distributed.context_parallel.context_parallel import compute_cp_positions
from torchtitan.distributed.mesh import WorldMesh
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.engine.builders import Builders, Checkpointer, Guard
from torchtitan.features.registry import Slot, enabled_builders
from torchtitan.launch.run_folder import run_folder
from torchtitan.spec import get_model_spec

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingParts:
    """``CoreParts`` and what a training loop adds: checkpoints, metrics, the step's guard, the step's runner and the
    features' seams (each a null object where its feature is off)."""

    core: CoreParts
    agreement: StepAgreement
    gradients: GradientSync
    stops: StopPolicy
    share: CheckpointShare
    fields: StepFields
    """Fields the replica groups add to each logged step's record."""
    modules: Mapping[str, nn.Module]
    """Modules the step runs besides the model (RL's frozen reference), in the checkpoints too."""
    checkpointer: Checkpointer
    start_step: int
    metrics: Metrics
    signals: StopSignals
    guard: Guard
    step_pass: StepPass
    runner: StepRunner
    after_step: tuple[AfterStep, ...] = field(default_factory=tuple)


def _builds(builders: Builders, config: JobConfig, slot: Slot) -> list[Callable[..., Any]]:
    """The builders of ``slot`` of every enabled feature, in the registry's order (the estimator's under
    ``builders.estimate``)."""
    return [build for _, build in enabled_builders(config, slot, estimate=builders.estimate)]


def _slot(builders: Builders, config: JobConfig, slot: Slot, default: Any, *args: Any, **kwargs: Any) -> Any:
    """The one feature's part for ``slot`` (a caller's override first), or ``default`` where none is on."""
    found = _builds(builders, config, slot)
    if not found:
        return default
    assert len(found) == 1, f"two features fill the {slot} seam: {found}"
    return builders.overrides.get(slot, found[0])(*args, **kwargs)


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
    data_loader = _slot(builders, config, "data_loader", None, config, tokenizer, shard, model_args)
    if data_loader is None:
        data_loader = builders.data_loader(config.training, tokenizer, shard, model_args)
    features = model_features(config, spec, device, estimate=builders.estimate)
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
        features=features,
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
        transforms=features.transforms,
    )


def build_training_parts(core: CoreParts, *, builders: Builders) -> TrainingParts:
    """The replica groups, the step's modules, the checkpointer (and the load: the step the run continues after),
    metrics, the after-step work, the guard, the step pass and the step's runner, in that order."""
    config = core.config
    groups = _slot(builders, config, "group_seams", None, core)  # one object, every group seam
    if groups is None:
        agreement, gradients, stops, share, fields = (
            OneGroup(),
            LocalGradients(),
            StopAnytime(),
            OwnCheckpoints(),
            NoFields(),
        )
    else:
        agreement = gradients = stops = share = fields = groups
    modules = _slot(builders, config, "step_modules", {}, core, meta_model=builders.meta_model)
    checkpointer = builders.checkpointer(core, share, modules)
    start_step = builders.load(core, checkpointer)
    for after_load in _builds(builders, config, "after_load"):
        after_load(core)  # e.g. QLoRA: the loaded base as NF4
    if start_step > 0:
        changed = apply_optimizer_config(core.optimizer, core.lr_scheduler, config.optimizer, core.model_parts)
        if core.rank == 0 and changed:
            logger.info("resume: the config's optimizer settings replace the checkpoint's: %s", "; ".join(changed))
    agreement.resume_at(start_step)
    metrics = builders.metrics(core, gradients, start_step=start_step)
    after_step = tuple(build(core, metrics) for build in _builds(builders, config, "after_step"))
    signals = StopSignals()
    guard = builders.guard(core, metrics, signals)
    step_pass = _slot(builders, config, "step_pass", DirectPass(), core)
    seams = dict(agreement=agreement, gradients=gradients, guard=guard, start_step=start_step)
    runner = _slot(builders, config, "step_runner", None, core, modules=modules, **seams)
    return TrainingParts(
        core=core,
        agreement=agreement,
        gradients=gradients,
        stops=stops,
        share=share,
        fields=fields,
        modules=modules,
        checkpointer=checkpointer,
        start_step=start_step,
        metrics=metrics,
        signals=signals,
        guard=guard,
        step_pass=step_pass,
        runner=runner if runner is not None else PretrainStep(core, step_pass=step_pass, **seams),
        after_step=after_step,
    )
