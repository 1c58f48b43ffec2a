"""A training run's checkpointer, with what the run's config decides about it (the model's record in every marker,
the data source, the part of the model its checkpoints hold), so the engine passes parts and the config, nothing
else."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torchtitan.checkpointing.common import model_info
from torchtitan.checkpointing.manager import CheckpointManager
from torchtitan.checkpointing.scope import WHOLE_MODEL, ModelScope
from torchtitan.datasets.tokenizer import tokenizer_digest

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig


def build_run_checkpointer(
    cfg: JobConfig, *, model_args: Any, scope: ModelScope = WHOLE_MODEL, **parts: Any
) -> CheckpointManager:
    """``CheckpointManager`` over the run's ``parts`` (its keyword arguments: root, run_folder, model_parts, optimizer,
    ...), with what ``cfg`` decides: the model's record for every marker (``model_args``: the built args, with the
    ``scope``'s own record), the data source, and the part of the model a checkpoint holds (``scope``)."""
    return CheckpointManager(
        cfg.checkpoint,
        dump_folder=cfg.job.dump_folder,
        model_info=scope.model_info(model_info(model=cfg.model, model_args=model_args)),
        data_info={
            "dataset": cfg.training.dataset,
            "dataset_path": cfg.training.dataset_path,
            "tokenizer": os.path.abspath(cfg.model.tokenizer_path),  # what generate.py and eval read it with
            # what a resume compares: the tokenizer's content, wherever the checkout or the tokenizer now lies
            "tokenizer_sha256": tokenizer_digest(cfg.model.tokenizer_path),
        },
        scope=scope,
        **parts,
    )
