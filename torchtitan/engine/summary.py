"""The block rank 0 logs before the first step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan.observability.console import format_layout, format_start_summary

if TYPE_CHECKING:
    from torchtitan.engine.parts import CoreParts


def start_summary(core: CoreParts) -> str:
    """Model, layout, batch, device, dump folder."""
    cfg, dims = core.config, core.parallel_dims
    return format_start_summary(
        model=f"{cfg.model.name} {cfg.model.flavor}",
        params=core.num_params,
        flop_params=core.num_flop_params,
        layout=format_layout(dims.degrees()),
        world_size=dims.world_size,
        global_batch=core.shard.degree * cfg.training.batch_size * cfg.training.gradient_accumulation_steps,
        training=cfg.training,
        device=str(core.device),
        dump_folder=core.run_folder,
    )
