"""Peak FLOP/s of the training device, the denominator of MFU, and where that number comes from.

GPUs: a datasheet table (dense, i.e. without 2:4 sparsity). CPUs: no datasheet fits (core count,
SIMD width, turbo, the thread count and which kernel a dtype and layout get all matter), so we time
the GEMMs the model itself runs (forward and backward of its linears, in its compute dtype, at the
rank's thread count), keep the fastest rate of several passes, and cache it if it is plausible
(`peak_cache`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from torchtitan.distributed.backend.device import synchronize
from torchtitan.observability.logging import warn_once
from torchtitan.observability.peak_cache import (
    CacheEntry,
    cache_path,
    cpu_cache_key,
    read_cache,
    why_implausible,
    write_cache,
)

logger = logging.getLogger(__name__)

_TERA = 1e12


@dataclass(frozen=True)
class GpuPeak:
    """Dense datasheet peaks in TFLOP/s; `tf32` is None where the GPU has no TF32-like mode."""

    bf16: float
    tf32: float | None
    fp32: float


# First match wins, so a name that is a substring of another comes after it
# ("H200" before "H20", "L40S" before "L40" before "L4", "H100 NVL"/"PCIe" before "H100").
GPU_PEAK_FLOPS: tuple[tuple[str, GpuPeak], ...] = (
    ("GB200", GpuPeak(bf16=2500.0, tf32=1250.0, fp32=90.0)),
    ("B200", GpuPeak(bf16=2250.0, tf32=1125.0, fp32=75.0)),
    ("H100 NVL", GpuPeak(bf16=835.0, tf32=417.5, fp32=60.0)),
    ("H100 PCIe", GpuPeak(bf16=756.0, tf32=378.0, fp32=51.0)),
    ("H100", GpuPeak(bf16=989.0, tf32=494.5, fp32=67.0)),  # SXM; its name has no form factor
    ("GH200", GpuPeak(bf16=989.0, tf32=494.5, fp32=67.0)),
    ("H200", GpuPeak(bf16=989.0, tf32=494.5, fp32=67.0)),
    ("H800", GpuPeak(bf16=989.0, tf32=494.5, fp32=67.0)),
    ("H20", GpuPeak(bf16=148.0, tf32=74.0, fp32=44.0)),
    ("A100", GpuPeak(bf16=312.0, tf32=156.0, fp32=19.5)),
    ("A800", GpuPeak(bf16=312.0, tf32=156.0, fp32=19.5)),
    ("A10G", GpuPeak(bf16=70.0, tf32=35.0, fp32=31.2)),
    ("L40S", GpuPeak(bf16=362.05, tf32=183.0, fp32=91.6)),
    ("L40", GpuPeak(bf16=181.05, tf32=90.5, fp32=90.5)),
    ("L4", GpuPeak(bf16=121.0, tf32=60.0, fp32=30.3)),
    ("MI355X", GpuPeak(bf16=2500.0, tf32=None, fp32=157.3)),
    ("MI325X", GpuPeak(bf16=1307.4, tf32=653.7, fp32=163.4)),
    ("MI300X", GpuPeak(bf16=1307.4, tf32=653.7, fp32=163.4)),
    ("MI250X", GpuPeak(bf16=383.0, tf32=None, fp32=95.7)),
)
_FALLBACK_GPU = "H100"

_HALF_DTYPES = (torch.bfloat16, torch.float16)
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class PeakFlops:
    """A device's peak FLOP/s and where the number comes from, named whenever an MFU looks wrong."""

    flops: float
    source: str  # e.g. "datasheet table: H100 bf16", "metrics.device_peak_flops = 1e+12"
    cached: CacheEntry | None = None  # where a measured CPU peak is cached; None for any other peak


@dataclass(frozen=True)
class LinearShape:
    """A linear layer as one micro-batch runs it: (tokens, in_features) @ (out_features, in_features)^T."""

    tokens: int
    in_features: int
    out_features: int


# Used when the caller knows nothing of the model: a 1024-wide block and its 4x FFN.
DEFAULT_LINEARS = (LinearShape(1024, 1024, 1024), LinearShape(1024, 1024, 4096))
# Measured GEMMs are capped here: rates level off well below these sizes, and one call of a
# 128k-vocab output projection would take minutes on a CPU.
_MAX_TOKENS = 2048
_MAX_WIDTH = 4096
# Passes over the GEMMs, each GEMM's calls spread over all of them: a burst of other load slows one
# pass, and the fastest call is kept. Named in the cache key: a number measured otherwise never matches.
PASSES = 3
_METHOD = f"fastest GEMM FLOP/s of {PASSES} passes"


def get_peak_flops(
    device: torch.device,
    dtype: torch.dtype,
    override: float = 0.0,
    *,
    linears: tuple[LinearShape, ...] = DEFAULT_LINEARS,
    float8: bool = False,
) -> PeakFlops:
    """Peak dense FLOP/s of one `device` for matmuls in `dtype`, with its source.

    Args:
        override: if > 0, returned as is (for hardware the table or benchmark gets wrong).
        linears: the model's linear layers; on CPU (and devices with no table) the peak is the
            fastest of their forward and backward GEMMs (see `measure_matmul_flops`).
        float8: a float8 run: the same peak as without float8 (that of `dtype`, not the float8
            peak), its source labelled so (see `label_float8_peak`).

    On CUDA/ROCm, float32 uses the TF32 (or MI300 XF32) peak when TF32 matmuls are on
    (`tf32_matmul_enabled`), since that is what the matmuls then run at,
    and the plain FP32 peak otherwise. On CPU the number is measured at the current
    `torch.get_num_threads()` and cached on disk if plausible (`peak_cache`). Other accelerators are
    measured each time, uncached.
    """
    if override > 0:
        note = " (float8 run: used as given)" if float8 else ""
        return PeakFlops(override, f"metrics.device_peak_flops = {override:.3g}{note}")
    peak = _device_peak(device, dtype, linears)
    return label_float8_peak(peak, dtype) if float8 else peak


def label_float8_peak(peak: PeakFlops, dtype: torch.dtype) -> PeakFlops:
    """A float8 run's MFU denominator: the peak the same run without float8 divides by, labelled so.

    Not a float8 peak (twice bf16's on Hopper): only the converted linears run float8 GEMMs (the
    output head, filtered linears and attention's score/value matmuls stay in `dtype`), and the same
    model FLOPs over the same denominator make a float8 run's MFU compare directly with the bf16
    run's: float8's speed-up shows as a higher MFU.
    """
    return dataclasses.replace(peak, source=f"{peak.source}, vs {_dtype_name(dtype)} peak (float8 run)")


def _device_peak(device: torch.device, dtype: torch.dtype, linears: tuple[LinearShape, ...]) -> PeakFlops:
    if device.type == "cuda":
        return _lookup_gpu_peak(_get_device_name(device), dtype)
    if device.type == "cpu":
        return _cached_cpu_peak(dtype, linears)
    warn_once(logger, f"no peak FLOPS table for device type '{device.type}'; measuring the model's GEMMs instead")
    flops = measure_matmul_flops(device, dtype, linears)
    return PeakFlops(flops, f"measured on {device.type}: {_dtype_name(dtype)} GEMM = {flops / 1e9:.1f} GFLOP/s")


def tf32_matmul_enabled() -> bool:
    """Whether CUDA float32 matmuls run in TF32: torch's `fp32_precision` where it is set, else the legacy flag.

    Reading `allow_tf32` after the new API set a precision raises in torch >= 2.9 ("mix of the legacy and new
    APIs"), so the new setting is read first; `torch.set_float32_matmul_precision` sets both.
    """
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if precision != "none":
        return precision == "tf32"
    return bool(torch.backends.cuda.matmul.allow_tf32)


def _get_device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _lookup_gpu_peak(device_name: str, dtype: torch.dtype) -> PeakFlops:
    name = next((key for key, _ in GPU_PEAK_FLOPS if key in device_name), None)
    note = ""
    if name is None:
        warn_once(
            logger,
            f"unknown GPU '{device_name}': using the {_FALLBACK_GPU} SXM peak FLOPS, so MFU is "
            "only a rough guide; set the peak FLOPS override for an exact number",
        )
        name, note = _FALLBACK_GPU, f" (unknown GPU '{device_name}')"
    peak = dict(GPU_PEAK_FLOPS)[name]
    if dtype in _HALF_DTYPES:
        tflops, column = peak.bf16, "bf16"
    elif dtype == torch.float32:
        use_tf32 = tf32_matmul_enabled() and peak.tf32 is not None
        tflops, column = (peak.tf32, "tf32") if use_tf32 else (peak.fp32, "fp32")
    else:
        raise NotImplementedError(
            f"no GPU peak FLOPS for dtype {dtype}; supported: bfloat16, float16, float32 (or pass an override)"
        )
    return PeakFlops(tflops * _TERA, f"datasheet table: {name} {column}{note}")


def _gemms(linears: tuple[LinearShape, ...]) -> list[tuple[str, int, int, int]]:
    """(layout, m, k, n) of every GEMM training runs for `linears`, capped in size, without repeats.

    For y = x @ W^T with x (T, I) and W (O, I): forward "NT" (T, I, O); the input gradient
    dy @ W, "NN" (T, O, I); the weight gradient dy^T @ x, "TN" (O, T, I). Layouts and sizes matter:
    a CPU without oneDNN's bf16 kernels (no AVX-512, e.g. AMD Zen 2/3) runs bf16 GEMMs in ATen's
    fallback, whose "NN" case is a strided loop: 0.17 GFLOP/s at 1024^3 against 6.5 for "NT" on a
    Xeon with oneDNN turned off. The benchmark this replaced, one square 2048^3 "NN" GEMM, measured
    0.20 GFLOP/s that way (0.30 on an AMD EPYC), a tenth of what the model's own GEMMs reached.
    """
    gemms: list[tuple[str, int, int, int]] = []
    for shape in linears:
        t = min(shape.tokens, _MAX_TOKENS)
        i, o = min(shape.in_features, _MAX_WIDTH), min(shape.out_features, _MAX_WIDTH)
        for gemm in (("NT", t, i, o), ("NN", t, o, i), ("TN", o, t, i)):
            if gemm not in gemms:
                gemms.append(gemm)
    return gemms


def _gemm_operands(
    layout: str, m: int, k: int, n: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) with a @ b of shape (m, n); a "T" in `layout` makes that operand a transposed view."""

    def operand(transposed: bool, rows: int, cols: int) -> torch.Tensor:
        if transposed:
            return torch.randn(cols, rows, device=device).to(dtype).t()
        return torch.randn(rows, cols, device=device).to(dtype)

    return operand(layout[0] == "T", m, k), operand(layout[1] == "T", k, n)


def _time_gemm(
    a: torch.Tensor, b: torch.Tensor, budget_s: float, give_up_s: float, *, warm_up: bool
) -> tuple[float, int]:
    """(fastest seconds per call, timed calls): calls until `budget_s` passes, after an untimed one if `warm_up`.

    A first call slower than `give_up_s` is the only one: that GEMM is far from the fastest, and
    timing it again (minutes on a slow CPU kernel) would not change the maximum.
    """
    if warm_up:
        start = time.perf_counter()
        torch.mm(a, b)  # the first call of a shape also creates (JITs) oneDNN's kernel for it
        synchronize(a.device)
        first = time.perf_counter() - start
        if first >= give_up_s:
            return first, 1
    rep_times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while not rep_times or time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(a.device)
        rep_times.append(time.perf_counter() - start)
    return min(rep_times), len(rep_times)


def measure_matmul_flops(
    device: torch.device,
    dtype: torch.dtype,
    linears: tuple[LinearShape, ...] = DEFAULT_LINEARS,
    *,
    budget_s: float = 1.0,
    passes: int = PASSES,
) -> float:
    """The fastest FLOP/s among the forward and backward GEMMs of `linears` in `dtype` on `device`.

    `passes` passes over the GEMMs: each GEMM gets one untimed call in the first, then timed calls for
    its share of `budget_s` in every pass where it is within 2x of the fastest so far. Uses the current
    `torch.get_num_threads()` on CPU, so measure with the training thread count. Takes the fastest
    call: on a shared machine other load only ever slows a call down, and the fastest of the model's
    own GEMMs is the best this device does on this model, so the model's MFU stays under 100% (up to
    noise and the causal half of attention, which the FLOP count includes).
    """
    gemms = _gemms(linears)
    rates = dict.fromkeys(gemms, 0.0)
    too_slow: set[tuple[str, int, int, int]] = set()  # one call took the whole budget: far from the fastest
    for index in range(passes):
        best = max(rates.values())
        # Later passes time only the GEMMs that may still be the fastest (load only slows a call), so
        # a large model's GEMMs, up to a second a call on a CPU, are not all timed `passes` times.
        for gemm in [g for g in gemms if index == 0 or (g not in too_slow and rates[g] >= best / 2)]:
            layout, m, k, n = gemm
            a, b = _gemm_operands(layout, m, k, n, device, dtype)
            seconds, reps = _time_gemm(a, b, budget_s / (passes * len(gemms)), budget_s, warm_up=index == 0)
            rate = 2 * m * k * n / seconds
            rates[gemm] = max(rates[gemm], rate)
            if seconds >= budget_s:
                too_slow.add(gemm)
            logger.debug("pass %d: GEMM %s %dx%dx%d %s: %.1f GFLOP/s (%d calls)", index, *gemm, dtype, rate / 1e9, reps)
    best_gemm = max(gemms, key=rates.__getitem__)
    logger.debug("fastest GEMM: %s %dx%dx%d at %.1f GFLOP/s", *best_gemm, rates[best_gemm] / 1e9)
    return rates[best_gemm]


def _cpu_cache_key(dtype: torch.dtype, linears: tuple[LinearShape, ...]) -> str:
    """The cache key of the CPU peak of `linears`' GEMMs in `dtype`, measured as `measure_matmul_flops` does."""
    return cpu_cache_key(_METHOD, dtype, _gemms(linears))


def _cpu_source(dtype: torch.dtype, flops: float, where: str) -> str:
    threads = torch.get_num_threads()
    return f"measured on CPU: {_dtype_name(dtype)} GEMM at {threads} threads = {flops / 1e9:.1f} GFLOP/s, {where}"


def _cached_cpu_peak(dtype: torch.dtype, linears: tuple[LinearShape, ...]) -> PeakFlops:
    """The cached peak if plausible, else measured now (one log line) and cached if that is plausible."""
    path, key, threads = cache_path(), _cpu_cache_key(dtype, linears), torch.get_num_threads()
    entries, problem = read_cache(path)
    if key in entries:
        problem = why_implausible(key, entries[key], entries, threads=threads)
        if problem is None:
            flops = float(entries[key])
            return PeakFlops(flops, _cpu_source(dtype, flops, f"cached in {path}"), CacheEntry(path, key))
    start = time.perf_counter()
    flops = measure_matmul_flops(torch.device("cpu"), dtype, linears)
    seconds = time.perf_counter() - start
    line = (
        f"measured CPU peak {flops / 1e9:.1f} GFLOP/s ({_dtype_name(dtype)}, {threads} threads, fastest of "
        f"{PASSES} passes over {len(_gemms(linears))} GEMMs of the model's linears) in {seconds:.2f} s"
    )
    if problem is not None:
        line = f"not using the CPU peak cached in {path}: {problem}; re-{line}"
    doubt = why_implausible(key, flops, entries, threads=threads)
    if doubt is not None:
        # The machine is busy now: this run divides by what it measured, and the cache keeps what it had.
        logger.warning("%s, but %s: not cached, the next run measures again", line, doubt)
        return PeakFlops(flops, _cpu_source(dtype, flops, "not cached (implausible)"))
    entries[key] = flops
    failed = write_cache(path, entries)
    if failed is not None:
        logger.warning("%s; %s, the next run measures again", line, failed)
        return PeakFlops(flops, _cpu_source(dtype, flops, "not cached"))
    logger.log(logging.INFO if problem is None else logging.WARNING, "%s; cached in %s", line, path)
    return PeakFlops(flops, _cpu_source(dtype, flops, f"cached in {path}"), CacheEntry(path, key))
