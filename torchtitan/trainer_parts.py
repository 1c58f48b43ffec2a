"""The trainer's default builders of its outside-world parts: metrics, checkpoints, validation, the step guard,
the step replay and fault tolerance's replica groups (the ``TrainerBuilders`` fields the memory estimator replaces; build.py).

Each takes the ``Trainer`` being built (torchtitan.train, which imports this module), complete up to the part
being built.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchtitan.build import TrainerBuilders
from torchtitan.checkpointing.common import model_info
from torchtitan.checkpointing.manager import CheckpointManager
from torchtitan.components.replay import build_step_replay
from torchtitan.components.run_control import StepGuard
from torchtitan.components.validation import Validator
from torchtitan.datasets.shard import DataShard, ReportsDataMix
from torchtitan.launch.run_folder import checkpoint_root
from torchtitan.observability.console import format_layout, format_start_summary
from torchtitan.observability.step_metrics import StepMetrics

if TYPE_CHECKING:
    from torchtitan.fault_tolerance.replicas import Replicas

logger = logging.getLogger(__name__)

Trainer = Any  # torchtitan.train.Trainer: a type import would be an import circle (tests/unit/test_structure.py)


def _build_metrics(trainer: Trainer) -> StepMetrics:
    cfg = trainer.config
    return StepMetrics(
        metrics=cfg.metrics,
        training=cfg.training,
        float8=cfg.float8,
        cp_degree=trainer.parallel_dims.cp,
        dump_folder=trainer.run_folder,
        wandb_config=cfg.to_dict(),
        start_step=trainer.step,
        device=trainer.device,
        enabled=trainer.rank == 0,
        reduce_loss=_reduce_loss(trainer),
        num_params=trainer.num_flop_params,
        model_args=trainer.model_args,
        documents=trainer.step_fn.feed.take_stats if trainer.step_fn.feed is not None else None,
        data_mix=trainer.data_loader.step_metrics if isinstance(trainer.data_loader, ReportsDataMix) else None,
    )


def _reduce_loss(trainer: Trainer) -> Callable[[torch.Tensor], tuple[float, float]]:
    """The logged (mean, max) of a per-rank loss; under fault tolerance the max is over the groups' too."""
    replicas, reduce = trainer.replicas, trainer.step_fn.reduce_loss
    if replicas is None:
        return reduce
    return lambda loss: reduce(loss, max_source=replicas.loss_max)


def build_checkpointer(trainer: Trainer, *, before_marker: Callable[[int], None] | None = None) -> CheckpointManager:
    """The trainer's default ``TrainerBuilders.checkpointer``; ``before_marker``: see ``CheckpointManager``.

    Under fault tolerance the data position saved is every replica group's (``DataPositions``), so the shared
    checkpoint one group writes resumes all of them (semi-sync: each group's own folder, with the outer
    optimizer); the run's own files (metrics) are in its replica folder.
    """
    cfg = trainer.config
    replicas = trainer.replicas
    return CheckpointManager(
        cfg.checkpoint,
        dump_folder=cfg.job.dump_folder,
        run_folder=trainer.run_folder,
        root=checkpoint_root(cfg),
        extra=replicas.checkpoint_state() if replicas is not None else None,
        sets_aside_later=replicas is None or _rolls_back_shared(cfg),
        model_parts=trainer.model_parts,
        optimizer=trainer.optimizer,
        lr_scheduler=trainer.lr_scheduler,
        data_loader=trainer.data_loader if replicas is None else replicas.positions,
        dp_rank=trainer.world.local_rank("dp"),
        rank=trainer.rank,
        device=trainer.device,
        model_info=model_info(model=cfg.model, model_args=trainer.model_args, lora=cfg.lora, checkpoint=cfg.checkpoint),
        data_info={"dataset": cfg.training.dataset, "dataset_path": cfg.training.dataset_path},
        before_marker=before_marker,
        lora=cfg.lora if cfg.lora.enable else None,
    )


def _rolls_back_shared(cfg: Any) -> bool:
    """Under fault tolerance the groups share the checkpoint folder (but in semi-sync): only an explicit rollback
    (checkpoint.load_step) moves newer checkpoints aside, and only replica group 0 does; a plain resume takes the
    newest, and anything newer is a live group's save that completed meanwhile."""
    ft = cfg.fault_tolerance
    return ft.semi_sync_method is not None or (ft.replica_id == 0 and cfg.checkpoint.load_step >= 0)


def _build_validator(trainer: Trainer, tokenizer) -> Validator:
    ft = trainer.config.fault_tolerance
    shard, microbatches = trainer.shard, 1
    if ft.enable:  # each replica group evaluates the whole global batch (components/validation.py)
        shard, microbatches = DataShard(trainer.world.local_rank("dp"), trainer.parallel_dims.dp_degree), ft.group_size
    return Validator(
        tokenizer,
        validation=trainer.config.validation,
        training=trainer.config.training,
        shard=shard,
        step_fn=trainer.step_fn,
        shard_batch=trainer.shard_batch,
        microbatches=microbatches,
    )


def _build_evaluator(trainer: Trainer) -> Any:
    from torchtitan.eval.loop import build_in_loop_eval  # lm-eval loads only for a run with [eval] enabled

    return build_in_loop_eval(trainer)


def build_guard(trainer: Trainer) -> StepGuard:
    """The trainer's default ``TrainerBuilders.guard``."""
    cfg = trainer.config.training
    on_wait = trainer.metrics.add_wait if trainer.config.metrics.straggler_factor > 0 else None
    return StepGuard(cfg.on_nonfinite, cfg.max_nonfinite_skips, trainer.device, trainer.signals, on_wait=on_wait)


def build_replicas(trainer: Trainer) -> Replicas:
    """The trainer's default ``TrainerBuilders.replicas`` (fault tolerance on)."""
    from torchtitan.fault_tolerance.setup import build_replica_groups  # imports torchft's wrappers only when on

    return build_replica_groups(
        trainer.config,
        world=trainer.world,
        rank=trainer.rank,
        model_parts=trainer.model_parts,
        optimizer=trainer.optimizer,
        lr_scheduler=trainer.lr_scheduler,
        data_loader=trainer.data_loader,
    )


def load_start_weights(trainer: Trainer) -> int:
    """The checkpointer's load (returns the step training continues after); then, with ``lora.quantize_base``,
    the frozen base just loaded becomes NF4 (lora/quantize.py), before the first forward."""
    step = trainer.checkpointer.load()
    if trainer.config.lora.enable and trainer.config.lora.quantize_base == "nf4":
        from torchtitan.lora.quantize import quantize_base

        n = quantize_base(trainer.model_parts)
        if trainer.rank == 0:
            logger.info("lora.quantize_base = 'nf4': %d frozen base linears stored as NF4", n)
    return step


def start_summary(trainer: Trainer, num_params: int) -> str:
    """The block rank 0 logs before the first step: model, layout, batch, device, dump folder."""
    cfg, dims = trainer.config, trainer.parallel_dims
    return format_start_summary(
        model=f"{cfg.model.name} {cfg.model.flavor}",
        params=num_params,
        flop_params=trainer.num_flop_params,
        layout=format_layout(dims.degrees()),
        world_size=dims.world_size,
        global_batch=trainer.shard.degree * cfg.training.batch_size * cfg.training.gradient_accumulation_steps,
        training=cfg.training,
        device=str(trainer.device),
        dump_folder=trainer.run_folder,
    )


def with_trainer_defaults(builders: TrainerBuilders) -> TrainerBuilders:
    """``builders`` with this module's default for every trainer-level part it leaves None."""
    defaults: dict[str, Any] = dict(metrics=_build_metrics, checkpointer=build_checkpointer, guard=build_guard)
    defaults.update(
        validator=_build_validator, evaluator=_build_evaluator, replicas=build_replicas, replay=build_step_replay
    )
    return dataclasses.replace(builders, **{k: v for k, v in defaults.items() if getattr(builders, k) is None})
