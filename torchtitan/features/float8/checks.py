"""Float8's pre-launch checks (light: no torchao import): the keys against each other and the layout, and that
torchao is installed on this machine. What the device can run is checked at build (float8.py's
``check_float8_runs``)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from torchtitan.config.errors import ConfigError

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.config.schema import Float8
    from torchtitan.distributed.parallel_dims import ParallelDims

TORCHAO_PIN = "torchao==0.18.0"


def check_float8(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Pre-launch: the float8 keys against each other and the layout (no torchao import)."""
    exp = config.experimental
    ring = dims.tp_enabled and exp.enable_async_tensor_parallel and exp.async_tensor_parallel_impl != "compiler"
    check_float8_config(
        config.float8, fsdp_enabled=dims.fsdp_enabled, ring_async_tp=ring and not config.training.compile
    )
    return []


def check_torchao_installed(config: JobConfig, dims: ParallelDims) -> list[str]:
    """This machine: float8 needs torchao installed (found, not imported: it is slow to import)."""
    if config.float8.enable_float8_linear and importlib.util.find_spec("torchao") is None:
        raise NotImplementedError(
            f"float8.enable_float8_linear = true needs torchao, which is not installed; pip install {TORCHAO_PIN}"
        )
    return []


def check_float8_config(cfg: Float8, *, fsdp_enabled: bool, ring_async_tp: bool = False) -> None:
    """The float8 keys that contradict each other or name something not built; no torchao import."""
    if not cfg.enable_float8_linear:
        others = [
            k for k in ("enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp") if getattr(cfg, k)
        ]
        if others:
            raise ConfigError(
                f"float8.{others[0]} = true needs float8.enable_float8_linear = true; set it, or turn {others[0]} off"
            )
        return
    for key in ("scaling_type_input", "scaling_type_weight", "scaling_type_grad_output"):
        if getattr(cfg, key) != "dynamic":
            raise NotImplementedError(
                f"float8.{key} = {getattr(cfg, key)!r}: delayed scaling was removed from torchao (it is not in "
                f"{TORCHAO_PIN}); use 'dynamic' (the default)"
            )
    if cfg.recipe_name == "mxfp8":
        raise NotImplementedError(
            "float8.recipe_name = 'mxfp8': torchao 0.18's MX training (torchao.prototype.moe_training.MXFP8Linear) "
            "needs CUDA kernels for Blackwell GPUs that this build does not have; use 'tensorwise' or 'rowwise'"
        )
    tensorwise_only = ["enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp"]
    tensorwise_only += ["force_recompute_fp8_weight_in_bwd"]
    for key in tensorwise_only:
        if getattr(cfg, key) and cfg.recipe_name != "tensorwise":
            raise ConfigError(
                f"float8.{key} = true with float8.recipe_name = {cfg.recipe_name!r}: torchao supports it for the "
                "'tensorwise' recipe only; use recipe_name = 'tensorwise' or turn it off"
            )
    if cfg.precompute_float8_dynamic_scale_for_fsdp and not cfg.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "float8.precompute_float8_dynamic_scale_for_fsdp = true needs float8.enable_fsdp_float8_all_gather = true "
            "(the precomputed scales are those of the float8 all-gather); set it or turn precompute off"
        )
    if ring_async_tp:
        _check_ring_async_tp(cfg)
    if cfg.enable_fsdp_float8_all_gather and not fsdp_enabled:
        raise ConfigError(
            "float8.enable_fsdp_float8_all_gather = true without FSDP (data_parallel_shard_degree = 1): there is no "
            "all-gather to run in float8; turn it off or shard over data-parallel ranks"
        )


def _check_ring_async_tp(cfg: Float8) -> None:
    """Our async TP ring casts with tensorwise scales and does not take FSDP's float8-cast weights."""
    if cfg.recipe_name != "tensorwise":
        raise NotImplementedError(
            f"float8.recipe_name = {cfg.recipe_name!r} with experimental.enable_async_tensor_parallel (our ring): "
            "the ring's float8 GEMMs are tensorwise-scaled; use recipe_name = 'tensorwise' or turn async TP off"
        )
    if cfg.enable_fsdp_float8_all_gather:
        raise NotImplementedError(
            "float8.enable_fsdp_float8_all_gather with experimental.enable_async_tensor_parallel (our ring): the "
            "ring does not take FSDP's float8-cast weights yet; turn one of them off"
        )
