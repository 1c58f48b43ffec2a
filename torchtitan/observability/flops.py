"""Peak FLOP/s of the training device, the denominator of MFU.

GPUs: a datasheet table (dense, i.e. without 2:4 sparsity). CPUs: no datasheet fits (core count,
SIMD width, turbo and the thread count all matter), so we time a GEMM once and cache the result.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from torchtitan.distributed.device import synchronize
from torchtitan.observability.logging import warn_once

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


def get_peak_flops(device: torch.device, dtype: torch.dtype, override: float = 0.0) -> float:
    """Peak dense FLOP/s of one `device` for matmuls in `dtype`.

    Args:
        override: if > 0, returned as is (for hardware the table or benchmark gets wrong).

    On CUDA/ROCm, float32 uses the TF32 (or MI300 XF32) peak when
    `torch.backends.cuda.matmul.allow_tf32` is on, since that is what the matmuls then run at,
    and the plain FP32 peak otherwise. On CPU the number is measured (see `measure_matmul_flops`)
    and cached on disk. Other accelerators are measured each time, uncached.
    """
    if override > 0:
        return override
    if device.type == "cuda":
        return _lookup_gpu_peak(_get_device_name(device), dtype)
    if device.type == "cpu":
        return _cached_cpu_peak(dtype)
    warn_once(logger, f"no peak FLOPS table for device type '{device.type}'; measuring a GEMM instead")
    return measure_matmul_flops(device, dtype)


def _get_device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def _lookup_gpu_peak(device_name: str, dtype: torch.dtype) -> float:
    peak = next((p for key, p in GPU_PEAK_FLOPS if key in device_name), None)
    if peak is None:
        warn_once(
            logger,
            f"unknown GPU '{device_name}': using the {_FALLBACK_GPU} SXM peak FLOPS, so MFU is "
            "only a rough guide; set the peak FLOPS override for an exact number",
        )
        peak = dict(GPU_PEAK_FLOPS)[_FALLBACK_GPU]
    if dtype in _HALF_DTYPES:
        return peak.bf16 * _TERA
    if dtype == torch.float32:
        use_tf32 = torch.backends.cuda.matmul.allow_tf32 and peak.tf32 is not None
        return (peak.tf32 if use_tf32 else peak.fp32) * _TERA
    raise NotImplementedError(
        f"no GPU peak FLOPS for dtype {dtype}; supported: bfloat16, float16, float32 (or pass an override)"
    )


def measure_matmul_flops(
    device: torch.device,
    dtype: torch.dtype,
    *,
    size: int = 2048,
    budget_s: float = 0.5,
    num_warmup: int = 2,
) -> float:
    """Time square `size` x `size` matmuls in `dtype` on `device` and return FLOP/s.

    Runs `num_warmup` untimed matmuls, then timed ones until `budget_s` has passed (at least one).
    Uses the current `torch.get_num_threads()` on CPU, so measure with the training thread count.
    Returns the fastest rep: on a shared machine other load only ever slows a rep down, so the
    fastest is the best estimate of what the hardware can do.
    """
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    for _ in range(num_warmup):
        torch.mm(a, b, out=out)
    synchronize(device)
    rep_times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while not rep_times or time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        synchronize(device)
        rep_times.append(time.perf_counter() - start)
    flops = 2 * size**3 / min(rep_times)
    logger.debug(
        "matmul %d^2 %s on %s: best %.1f GFLOP/s, median %.1f GFLOP/s over %d reps",
        size,
        dtype,
        device,
        flops / 1e9,
        2 * size**3 / statistics.median(rep_times) / 1e9,
        len(rep_times),
    )
    return flops


def _cache_path() -> Path:
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(cache_home) / "torchtitan" / "peak_flops.json"


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_cache_key(dtype: torch.dtype) -> str:
    return f"{_cpu_model_name()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"


def _cached_cpu_peak(dtype: torch.dtype) -> float:
    path = _cache_path()
    key = _cpu_cache_key(dtype)
    entries = _read_cache(path)
    cached = entries.get(key)
    if isinstance(cached, (int, float)) and cached > 0:
        return float(cached)
    start = time.perf_counter()
    flops = measure_matmul_flops(torch.device("cpu"), dtype)
    logger.info(
        "measured CPU peak %.1f GFLOP/s (%s, %d threads) in %.2f s; caching it in %s",
        flops / 1e9,
        dtype,
        torch.get_num_threads(),
        time.perf_counter() - start,
        path,
    )
    entries[key] = flops
    _write_cache(path, entries)
    return flops


def _read_cache(path: Path) -> dict[str, object]:
    if not path.exists():
        return {}
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable peak FLOPS cache %s (%s); re-measuring", path, e)
        return {}
    if not isinstance(entries, dict):
        logger.warning("ignoring peak FLOPS cache %s: not a JSON object; re-measuring", path)
        return {}
    return entries


def _write_cache(path: Path, entries: dict[str, object]) -> None:
    # Write to a temp file and rename so that concurrent ranks never read a half-written file.
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            tmp_name = f.name
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp_name, path)
    except OSError as e:
        logger.warning("could not write peak FLOPS cache %s (%s); will re-measure next run", path, e)
        if tmp_name is not None and os.path.exists(tmp_name):
            os.remove(tmp_name)
