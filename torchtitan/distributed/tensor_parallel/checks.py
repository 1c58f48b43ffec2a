"""Pre-launch checks of tensor parallel and async TP (light: no DTensor import; the preflight runs them).

``resolve_async_tp`` is also what parallelize calls, so the refusal of ring async TP under compile
lives here once, with one message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchtitan.config.errors import ConfigError

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.config.schema import Experimental, Model, Training
    from torchtitan.distributed.parallel_dims import ParallelDims


def resolve_async_tp(*, experimental: Experimental, compile: bool, device_type: str) -> str | None:
    """None (sync TP), "ring" (ours, any backend) or "compiler" (torch's, CUDA + compile).

    Raises:
        NotImplementedError: ring async TP with compile (the ring is eager point-to-point code).
    """
    if not experimental.enable_async_tensor_parallel:
        return None
    impl = experimental.async_tensor_parallel_impl
    if impl == "auto":
        impl = "compiler" if device_type == "cuda" and compile else "ring"  # device-choice
    if impl == "ring" and compile:
        asked = experimental.async_tensor_parallel_impl
        how = "'ring'" if asked == "ring" else f"{asked!r}, which is 'ring' without CUDA,"
        raise NotImplementedError(
            f"experimental.async_tensor_parallel_impl = {how} with training.compile = true: the ring is eager "
            "point-to-point code that full-graph compile cannot trace; turn one of them off"
        )
    return impl


def check_tensor_parallel(config: JobConfig, dims: ParallelDims) -> list[str]:
    """TP shards heads and kv heads (the family checks its FFN width); sequence parallel shards the sequence."""
    t, exp = config.training, config.experimental
    tp = t.tensor_parallel_degree
    if dims.dp_replicate_enabled and not dims.fsdp_enabled and dims.tp_enabled:
        raise NotImplementedError(
            "DDP (data_parallel_replicate_degree > 1, data_parallel_shard_degree = 1) with tensor parallel "
            "is not supported; use HSDP (data_parallel_shard_degree > 1) or FSDP with TP"
        )
    if tp == 1:
        if exp.enable_async_tensor_parallel:
            raise ConfigError(
                "experimental.enable_async_tensor_parallel = true needs training.tensor_parallel_degree > 1"
            )
        if not t.enable_loss_parallel:
            return ["training.enable_loss_parallel = false has no effect without tensor parallel"]
        return []
    if exp.async_tensor_parallel_impl == "ring":  # refused whatever the device; 'auto': the device check
        resolve_async_tp(experimental=exp, compile=t.compile, device_type="cpu")
    if exp.enable_async_tensor_parallel and exp.async_tensor_parallel_impl == "compiler" and not t.compile:
        raise ConfigError(
            "experimental.async_tensor_parallel_impl = 'compiler' needs training.compile = true "
            "(the overlap is a compiler pass); set it, or use 'ring'"
        )
    return []


def check_tp_shapes(args: Any, *, model: Model, training: Training) -> None:
    """The flavor's heads and kv heads, and the sequence (sequence parallel), split over the TP ranks.

    Called by the model check (spec.check_model), which knows the flavor's ``args``; the family's own check
    adds its FFN width.
    """
    tp = training.tensor_parallel_degree
    if tp == 1:
        return
    sizes = {
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads or args.n_heads,
        "training.seq_len (sequence parallel)": training.seq_len,
    }
    for name, size in sizes.items():
        if size % tp:
            raise ConfigError(
                f"model {model.flavor}: {name} = {size} is not divisible by "
                f"training.tensor_parallel_degree = {tp}; choose a TP degree that divides it"
            )


def check_async_tp_device(config: JobConfig, dims: ParallelDims, device_type: str) -> list[str]:
    """On ``device_type``: what 'auto' async TP resolves to there composes with compile (explicit 'ring' included)."""
    if dims.tp_enabled:
        resolve_async_tp(experimental=config.experimental, compile=config.training.compile, device_type=device_type)
    return []
