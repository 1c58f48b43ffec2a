"""Float8 training with torchao: which linears convert, the recipe, and the checks that refuse what cannot run.

Order (its ``model_transform``, run by ``build.finish_model_part``): the meta model is converted first, then
parallelized. A
converted linear is torchao's ``Float8Linear``: the same ``weight`` parameter (same name, shape and
dtype as the ``nn.Linear`` it replaces, so checkpoints interchange with bf16 runs), whose forward
casts input and weight to float8 with dynamic scales, multiplies with ``torch._scaled_mm`` and
returns the high-precision dtype; backward casts the output gradient the same way. The parallelisms
then see ordinary linears: TP uses torchao's float8 styles (tensorwise), FSDP all-gathers float8
weights when ``enable_fsdp_float8_all_gather`` is set. Initial weights do not change: the
conversion happens on the meta device and init fills the same parameters from the seed.

Kept in high precision: the output head (always: the logits' precision drives the loss), every
linear whose name contains one of ``filter_fqns``, and linears whose in/out features are not
multiples of 16 (``_scaled_mm``'s constraint; e.g. the MoE router's ``num_experts``-wide gate).
MoE routed experts are one grouped GEMM over 3-D weights, not linears; torchao 0.18's float8
grouped GEMM (``torchao.prototype.moe_training``) does not run on this torch's CPU build and is a
prototype, so they stay in high precision, and the log says so.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from torchtitan.features.float8.checks import TORCHAO_PIN
from torchtitan.observability.logging import quiet_torchao_notes

if TYPE_CHECKING:
    from torchtitan.config.schema import Float8
    from torchtitan.distributed.mesh import OuterSum

logger = logging.getLogger(__name__)

DIM_MULTIPLE = 16  # _scaled_mm needs both GEMM dims of the weight divisible by 16
# CUDA float8 GEMMs need Ada (8.9) or Hopper (9.0) tensor cores or newer.
MIN_CUDA_CAPABILITY = (8, 9)
# The first release whose CPU _scaled_mm takes rowwise scales (torch 2.11's asserts one scale per operand);
# found by _probe_scaled_mm, named in its refusal.
ROWWISE_CPU_TORCH = "2.12"


def check_float8_runs(device: torch.device, recipe_name: str = "tensorwise") -> None:
    """Raise NotImplementedError naming what is missing when this process cannot train ``recipe_name`` in float8."""
    quiet_torchao_notes()
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise NotImplementedError(
            f"float8.enable_float8_linear = true needs torchao, which is not importable here ({e}); "
            f"pip install {TORCHAO_PIN}, or turn float8 off"
        ) from e
    if device.type == "cuda":  # device-choice: the GPU's float8 tensor cores
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CUDA_CAPABILITY:
            raise NotImplementedError(
                f"float8.enable_float8_linear = true on {torch.cuda.get_device_name(device)} (compute capability "
                f"{capability[0]}.{capability[1]}): float8 GEMMs need {MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]} "
                "or newer (Ada, Hopper, Blackwell); turn float8 off on this GPU"
            )
        return
    _probe_scaled_mm(device.type)
    if recipe_name.startswith("rowwise"):
        _probe_rowwise_scaled_mm(device.type, recipe_name)


@functools.cache
def _probe_scaled_mm(device_type: str) -> None:
    """One 16x16 float8 GEMM: torch builds differ in which devices have ``_scaled_mm``. On CPU either path will
    do, oneDNN's or torch's own (``cpu_float8_onednn_problem`` says which one a run takes)."""
    error = _float8_gemm_error(device_type, onednn=True if device_type == "cpu" else None)
    if error is None or (device_type == "cpu" and _float8_gemm_error("cpu", onednn=False) is None):
        return
    raise NotImplementedError(
        f"float8.enable_float8_linear = true: torch {torch.__version__} cannot run a float8 GEMM "
        f"(torch._scaled_mm) on device '{device_type}': {error}; turn float8 off"
    )


@functools.cache
def _float8_gemm_error(device_type: str, *, onednn: bool | None) -> str | None:
    """Why a 16x16 float8 GEMM fails (with oneDNN on / off on CPU, None: as it is), or None where it runs."""
    a, one = torch.ones(16, 16, device=device_type).to(torch.float8_e4m3fn), torch.ones((), device=device_type)
    try:
        with torch.backends.mkldnn.flags(enabled=onednn) if onednn is not None else contextlib.nullcontext():
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        return str(e).splitlines()[0]  # oneDNN held to AVX2 builds no float8 matmul for the CPU's ISA
    return None


@functools.cache
def _probe_rowwise_scaled_mm(device_type: str, recipe_name: str) -> None:
    """The same GEMM with a scale per row of ``a`` and per column of ``b``, as the rowwise recipes run it."""
    a = torch.ones(16, 16, device=device_type).to(torch.float8_e4m3fn)
    scale_a, scale_b = torch.ones(16, 1, device=device_type), torch.ones(1, 16, device=device_type)
    try:
        torch._scaled_mm(a, a.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        raise NotImplementedError(
            f"float8.recipe_name = '{recipe_name}' on device '{device_type}' needs torch {ROWWISE_CPU_TORCH} or "
            f"newer (torch {torch.__version__}'s _scaled_mm takes one scale per operand there); use "
            "recipe_name = 'tensorwise'"
        ) from e


@functools.cache
def _onednn_float8_slowdown() -> float:
    """How many times slower torch's oneDNN float8 GEMM is than torch's own (emulated) one on this CPU.

    One thread, the fastest of 5 single GEMMs per path: on a loaded machine (2 cores under several processes)
    the ~50 us emulated GEMM took up to 14 ms at 2 threads (a thread pool waiting for a core), a 600x slowdown
    measured under 10x, and a float8 run then spent 11 minutes a step in oneDNN."""
    a, one = torch.randn(64, 64).to(torch.float8_e4m3fn), torch.ones(())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _seconds_of(a, one, onednn=True) / max(_seconds_of(a, one, onednn=False), 1e-9)
    finally:
        torch.set_num_threads(threads)


def _seconds_of(a: torch.Tensor, one: torch.Tensor, *, onednn: bool) -> float:
    with torch.backends.mkldnn.flags(enabled=onednn):
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # warm up
        times = []
        for _ in range(5):
            start = time.perf_counter()
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            times.append(time.perf_counter() - start)
        return min(times)


def cpu_float8_onednn_problem() -> str | None:
    """Why this process's float8 GEMMs must not go through oneDNN on CPU, or None where oneDNN may run them.

    torch 2.13 runs ``_scaled_mm`` (torchao's float8 GEMMs) through oneDNN where it can; on some CPUs oneDNN
    has no float8 GEMM at all, on others it is far slower than torch's own (measured on a Xeon with AMX:
    200-300x at 64-512 rows, 17.8 s for one forward and backward of a 2-layer MLP). Measured once per process
    (more than 10x slower counts); the caller applies the answer with ``turn_off_onednn`` at build time."""
    error = _float8_gemm_error("cpu", onednn=True)
    if error is not None:
        return f"oneDNN cannot run a float8 GEMM here ({error})"
    slowdown = _onednn_float8_slowdown()
    if slowdown > 10:
        return f"oneDNN's float8 GEMM is {slowdown:.0f}x slower than torch's own on this CPU"
    return None


def turn_off_onednn(reason: str) -> None:
    """Turn oneDNN off for this process (which also slows its bf16 GEMMs: a float8 CPU run is fp32 otherwise),
    saying why once; a no-op where it is off already."""
    if torch.backends.mkldnn.enabled:
        logger.info(
            "float8 on CPU: %s; oneDNN is turned off for this process (torch.backends.mkldnn.enabled = False)", reason
        )
        torch.backends.mkldnn.enabled = False


def float8_linear_config(cfg: Float8):
    """torchao's ``Float8LinearConfig`` for the recipe and the FSDP/recompute keys."""
    quiet_torchao_notes()
    from torchao.float8 import Float8LinearConfig

    if cfg.recipe_name == "tensorwise":
        return Float8LinearConfig(
            enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather,
            force_recompute_fp8_weight_in_bwd=cfg.force_recompute_fp8_weight_in_bwd,
        )
    return Float8LinearConfig.from_recipe_name(cfg.recipe_name)


def is_float8_friendly(linear: nn.Linear) -> bool:
    return linear.in_features % DIM_MULTIPLE == 0 and linear.out_features % DIM_MULTIPLE == 0


def high_precision_reason(
    fqn: str, module: nn.Module, filter_fqns: list[str], head: nn.Module | None = None
) -> str | None:
    """Why the linear ``fqn`` stays in high precision, or None when it converts. ``head``: the model's output head
    (its ``output``: our families' ``output``, a transformers model's ``lm_head``), never converted."""
    if module is head:
        return "the output head"
    matched = [f for f in filter_fqns if f in fqn]
    if matched:
        return f"float8.filter_fqns ({matched[0]!r})"
    if not is_float8_friendly(module):
        return f"{module.in_features}x{module.out_features} is not a multiple of {DIM_MULTIPLE}"
    return None


def apply_float8(model: nn.Module, cfg: Float8) -> list[str]:
    """Convert ``model``'s linears to torchao ``Float8Linear`` in place; returns the converted names."""
    from torchao.float8 import convert_to_float8_training

    kept: dict[str, str] = {}
    converted: list[str] = []
    head = getattr(model, "output", None)  # a pipeline stage without the head has none

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # torchao asks for containers too
        reason = high_precision_reason(fqn, module, cfg.filter_fqns, head)
        if reason is None:
            converted.append(fqn)
            return True
        kept[fqn] = reason
        return False

    convert_to_float8_training(model, config=float8_linear_config(cfg), module_filter_fn=convert)
    for fqn in converted:
        model.get_submodule(fqn).register_forward_pre_hook(_cast_to_cpu_autocast_dtype)
    _log_conversion(cfg, converted, kept, has_experts=_has_grouped_experts(model))
    return converted


def _cast_to_cpu_autocast_dtype(module: nn.Module, args: tuple) -> tuple | None:
    """Under CPU autocast, give the float8 linear its input in the autocast dtype.

    torchao 0.18's ``Float8Linear.forward`` does this for CUDA autocast only; on CPU the input stays
    fp32 while the output gradient comes back in bf16, and a high-precision weight-gradient GEMM
    (``rowwise_with_gw_hp``) then multiplies the two dtypes and fails.
    """
    x = args[0]
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu") and x.is_floating_point():
        return (x.to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None


def _has_grouped_experts(model: nn.Module) -> bool:
    from torchtitan.models.moe import GroupedExperts

    return any(isinstance(m, GroupedExperts) for m in model.modules())


def _log_conversion(cfg: Float8, converted: list[str], kept: dict[str, str], *, has_experts: bool) -> None:
    logger.info(
        "float8 (%s scaling, torchao): %d linears converted; kept in high precision: %s",
        cfg.recipe_name,
        len(converted),
        ", ".join(f"{name} ({why})" for name, why in kept.items()) or "none",
    )
    if has_experts:
        logger.info(
            "float8: the MoE routed experts' grouped GEMMs stay in high precision (torchao 0.18's float8 grouped "
            "GEMM is a CUDA prototype); attention, shared-expert and dense-FFN linears are float8"
        )


class Float8ScalePrecompute:
    """Step hooks: after each optimizer step, every FSDP float8 weight's scale in one all-reduce (torchao).

    Without it each block's float8 all-gather computes its weights' scales itself (one small
    all-reduce per weight). A dropped step (``discard_step``) leaves the weights, and so the scales, as they are.
    """

    def __init__(self, model_parts: list[nn.Module]):
        self.model_parts = model_parts

    def aux_loss(self, model_part: nn.Module, scale: float) -> None:
        return None

    def reduce_step(self, *, keep_metrics: bool, outer_sum: OuterSum | None) -> None:
        pass

    def after_optimizer_step(self) -> None:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in self.model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    def discard_step(self) -> None:
        pass

    def metrics(self) -> None:
        return None
