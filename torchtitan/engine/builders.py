"""``Builders``: how a run builds the parts that touch the outside world (the mesh, tokenizer file, data, metrics
files, checkpoints) or that a tool builds differently (the memory estimator builds under fake tensors).

Each field has a declared signature over typed parts (``CoreParts``, the replica groups' seams, the metrics), never a
half-built trainer. The defaults are a real training run's; the estimator passes its own (estimation/
fake_trainer.py). ``overrides`` swaps a feature's seam builder (tests inject faults through it) and
``estimate`` picks the registry's estimator builders (features/registry.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from torchtitan.build import build_data_loader, build_meta_model, build_model_args
from torchtitan.checkpointing.manager import CheckpointManager
from torchtitan.checkpointing.run import build_run_checkpointer
from torchtitan.components.run_control import Guard, StepGuard, StopSignals
from torchtitan.components.seams import Metrics, Tokenizer
from torchtitan.datasets.shard import ReportsDataMix
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.launch.run_folder import checkpoint_root
from torchtitan.observability.step_metrics import StepMetrics

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.components.group_seams import CheckpointShare, GradientSync
    from torchtitan.components.parts import CoreParts
    from torchtitan.config.schema import Model, Training
    from torchtitan.datasets.shard import DataShard
    from torchtitan.distributed.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)


class Checkpointer(Protocol):
    """What the loop uses of ``CheckpointManager``."""

    def load(self) -> int: ...
    def maybe_save(self, step: int, *, last: bool) -> None: ...
    def save_now(self, step: int) -> bool: ...
    def summary(self) -> str: ...
    def close(self) -> None: ...


def _build_world_mesh(parallel_dims: ParallelDims, device_type: str) -> DeviceMesh | None:
    return parallel_dims.build_mesh(device_type)


def _build_tokenizer(model: Model) -> Any:
    return build_tokenizer(model.tokenizer_path)


def build_metrics(core: CoreParts, gradients: GradientSync, *, start_step: int) -> StepMetrics:
    """The default ``Builders.metrics``: per-step records (console, metrics.jsonl, TensorBoard) on rank 0."""
    cfg, reduce = core.config, core.step_fn.reduce_loss
    return StepMetrics(
        metrics=cfg.metrics,
        training=cfg.training,
        float8=cfg.float8,
        cp_degree=core.parallel_dims.cp,
        dump_folder=core.run_folder,
        wandb_config=cfg.to_dict(),
        start_step=start_step,
        device=core.device,
        enabled=core.rank == 0,
        # the logged (mean, max) of a per-rank loss; with replica groups the max is over the groups' too
        reduce_loss=lambda loss: reduce(loss, max_source=gradients.loss_max),
        num_params=core.num_flop_params,
        model_args=core.model_args,
        documents=core.step_fn.feed.take_stats if core.step_fn.feed is not None else None,
        data_mix=core.data_loader.step_metrics if isinstance(core.data_loader, ReportsDataMix) else None,
    )


def build_checkpointer(
    core: CoreParts,
    share: CheckpointShare,
    modules: Mapping[str, nn.Module],
    *,
    before_marker: Callable[[int], None] | None = None,
) -> CheckpointManager:
    """The default ``Builders.checkpointer``; ``modules``: the step's modules besides the model (RL's frozen
    reference), saved beside what ``share`` adds; ``before_marker``: see ``CheckpointManager``.

    The data position saved is what ``share`` says (with replica groups: every group's, so the shared checkpoint one
    group writes resumes all of them); the run's own files (metrics) are in its run folder.
    """
    return build_run_checkpointer(
        core.config,
        root=checkpoint_root(core.config),
        run_folder=core.run_folder,
        extra={**share.checkpoint_state(), **modules},
        sets_aside_later=share.sets_aside_later,
        model_parts=core.model_parts,
        optimizer=core.optimizer,
        lr_scheduler=core.lr_scheduler,
        data_loader=share.data_state(core.data_loader),
        dp_rank=core.world.local_rank("dp"),
        rank=core.rank,
        device=core.device,
        model_args=core.model_args,
        scope=core.model_scope,
        before_marker=before_marker,
    )


def load_start_weights(core: CoreParts, checkpointer: Checkpointer) -> int:
    """The default ``Builders.load``: the checkpointer's load; returns the step training continues after."""
    return checkpointer.load()


def build_guard(core: CoreParts, metrics: Metrics, signals: StopSignals) -> StepGuard:
    """The default ``Builders.guard``: the per-step agreement on non-finite steps and stop signals."""
    cfg = core.config
    on_wait = metrics.add_wait if cfg.metrics.straggler_factor > 0 else None
    t = cfg.training
    return StepGuard(t.on_nonfinite, t.max_nonfinite_skips, core.device, signals, on_wait=on_wait)


@dataclass(frozen=True)
class Builders:
    """How a run builds its swappable parts. Defaults: a real training run. Signatures:

    mesh(parallel_dims, device_type) -> DeviceMesh | None
    tokenizer(model) -> Tokenizer (``model``: the ``[model]`` section)
    model_args(config, spec, vocab_size, *, device_type) -> the family's args
    meta_model(spec, model_args) -> nn.Module on the meta device (called once per pipeline stage too)
    data_loader(training, tokenizer, shard, model_args) -> iterable of (inputs, labels), stateful for checkpoints
    checkpointer(core, share, modules) -> Checkpointer (``share``: the replica groups' CheckpointShare; ``modules``:
        the step's modules besides the model)
    load(core, checkpointer) -> the step the run continues after
    metrics(core, gradients, *, start_step) -> Metrics (``gradients``: the replica groups' GradientSync)
    guard(core, metrics, signals) -> Guard
    """

    mesh: Callable[[ParallelDims, str], DeviceMesh | None] = _build_world_mesh
    tokenizer: Callable[[Model], Tokenizer] = _build_tokenizer
    model_args: Callable[..., Any] = build_model_args
    meta_model: Callable[[Any, Any], nn.Module] = build_meta_model
    data_loader: Callable[[Training, Tokenizer, DataShard, Any], Iterable] = build_data_loader
    checkpointer: Callable[..., Checkpointer] = build_checkpointer
    load: Callable[[CoreParts, Checkpointer], int] = load_start_weights
    metrics: Callable[..., Metrics] = build_metrics
    guard: Callable[[CoreParts, Metrics, StopSignals], Guard] = build_guard
    overrides: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    """A one-feature slot's builder (features/registry.py ``Slot``: data_shard, group_seams, optimizer_step,
    step_pass, ...) used instead of the enabled feature's."""
    estimate: bool = False
    """Build the features' seams for the memory estimator (the registry's ``estimate`` builders)."""
