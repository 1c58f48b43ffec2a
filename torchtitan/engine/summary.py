"""The block rank 0 logs before the first step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan.checkpointing.files.folders import resume_point
from torchtitan.checkpointing.files.marker import FULL
from torchtitan.datasets.indexed.format import find_prefixes
from torchtitan.features.registry import plan_terms
from torchtitan.launch.run_folder import checkpoint_root
from torchtitan.observability.console import format_data_source, format_layout, format_start_summary

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.engine.parts import TrainingParts


def start_summary(parts: TrainingParts) -> str:
    """Model, what trains, layout, batch, data, where the weights come from, device, dump folder."""
    core = parts.core
    cfg, dims = core.config, core.parallel_dims
    path = cfg.training.dataset_path
    return format_start_summary(
        model=f"{cfg.model.name} {cfg.model.flavor}",
        params=core.num_params,
        flop_params=core.num_flop_params,
        layout=format_layout(dims.degrees()),
        world_size=dims.world_size,
        global_batch=core.shard.degree * cfg.training.batch_size * cfg.training.gradient_accumulation_steps,
        training=cfg.training,
        # the data loader built by now: an indexed path's pairs exist (find_prefixes raised otherwise)
        data=format_data_source(cfg.training, indexed=path is not None and find_prefixes(path) is not None),
        start=describe_start(cfg, partial=core.model_scope.partial),
        # a feature that trains part of the model says what (its PlanTerms.summary, components/seams.py)
        trains=[s for t in plan_terms(cfg) if (s := t.summary(cfg, core.model_args, core.num_params)) is not None],
        device=str(core.device),
        dump_folder=core.run_folder,
        lines=parts.runner.summary_lines(),
    )


def describe_start(config: JobConfig, *, partial: bool) -> str:
    """Where the run's weights came from, as the load found them: a resumed checkpoint, a seed checkpoint, initial
    weights (``checkpoint.initial_load_path``) or the seed. ``partial``: the checkpoints hold part of the model (the
    rest, the base, is read from the initial weights on every start)."""
    ckpt = config.checkpoint
    found = resume_point(checkpoint_root(config), enabled=ckpt.enable_checkpoint, load_step=ckpt.load_step)
    initial = f"initial weights from {ckpt.initial_load_path}" + (" (Hugging Face)" if ckpt.initial_load_in_hf else "")
    if found is None:
        seed = config.training.seed or 0
        return initial if ckpt.initial_load_path else f"fresh: weights initialized from training.seed {seed}"
    if found.kind == FULL:
        resumed = f"resumed from step {found.step} ({found.path})"
        return f"{resumed}; base: {initial}" if partial and ckpt.initial_load_path else resumed
    return f"seed checkpoint {found.path} (model weights only)"
