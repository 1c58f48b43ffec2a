"""A training run's checkpointer, with what the run's config decides about it (the model's record in every marker,
the data source, a LoRA run's adapters-only saves), so the engine passes parts and the config, nothing else."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan.checkpointing.common import model_info
from torchtitan.checkpointing.manager import CheckpointManager

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from torchtitan.config.manager import JobConfig


def build_run_checkpointer(
    cfg: JobConfig,
    *,
    root: str,
    run_folder: str,
    extra: dict[str, Stateful],
    sets_aside_later: bool,
    model_parts: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    data_loader: Any,
    dp_rank: int,
    rank: int,
    device: torch.device,
    model_args: Any,
    before_marker: Callable[[int], None] | None = None,
) -> CheckpointManager:
    """``CheckpointManager`` over the run's parts; ``root``: the checkpoint folder (launch/run_folder.py)."""
    return CheckpointManager(
        cfg.checkpoint,
        dump_folder=cfg.job.dump_folder,
        run_folder=run_folder,
        root=root,
        extra=extra,
        sets_aside_later=sets_aside_later,
        model_parts=model_parts,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        data_loader=data_loader,
        dp_rank=dp_rank,
        rank=rank,
        device=device,
        model_info=model_info(model=cfg.model, model_args=model_args, lora=cfg.lora, checkpoint=cfg.checkpoint),
        data_info={"dataset": cfg.training.dataset, "dataset_path": cfg.training.dataset_path},
        before_marker=before_marker,
        lora=cfg.lora if cfg.lora.enable else None,
    )
