"""Pre-launch check of ``model.mtp_layers`` and ``training.mtp_loss_weight`` (multi-token prediction): a family that
builds the depths, and the layouts they are built for. Light: the preflight runs it before any process group."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan.config.errors import ConfigError
from torchtitan.models.common.mtp import builds_mtp
from torchtitan.spec import flavor_args, get_model_spec, model_names

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims


def mtp_families() -> list[str]:
    """The families whose model builds the depths (their args have ``mtp_layers`` and say ``builds_mtp``)."""
    return [name for name in model_names() if _has_mtp(name)]


def _has_mtp(name: str) -> bool:
    return any(builds_mtp(args) for args in get_model_spec(name).flavors.values())


def check_mtp(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Raise on MTP settings that cannot run as asked; warn of a weight with no depths to weigh."""
    depths, weight = config.model.mtp_layers, config.training.mtp_loss_weight
    key = f"model.mtp_layers = {depths}"
    if depths == 0:
        return []
    if not builds_mtp(flavor_args(config.model)):
        raise ConfigError(
            f"{key} with model.name = {config.model.name!r}: this family has no multi-token prediction; allowed: "
            f"model.mtp_layers = 0 here, or a family that builds it ({', '.join(mtp_families())}); set "
            "model.mtp_layers = 0"
        )
    unbuilt = (
        (
            dims.cp_enabled,
            f"experimental.context_parallel_degree = {dims.cp}",
            "depth k reads token i+k, which another rank's sequence shard holds",
        ),
        (
            config.training.loss_chunk_size > 0,
            f"training.loss_chunk_size = {config.training.loss_chunk_size}",
            "the chunked loss computes the model's logits only",
        ),
        (config.rl.enable, "rl.enable", "RL's update runs its own forward, without the depths"),
    )
    for found, setting, why in unbuilt:
        if found:
            raise NotImplementedError(
                f"{key} with {setting}: not built ({why}); set model.mtp_layers = 0 or drop {setting.split(' =')[0]}"
            )
    if weight == 0:
        return [f"{key} with training.mtp_loss_weight = 0: the depths are computed but learn nothing"]
    return []
