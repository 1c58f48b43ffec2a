"""The on-disk cache of measured CPU peaks, and which of its numbers to believe.

A CPU peak is measured once per key (`flops.measure_matmul_flops`) and kept in
``~/.cache/torchtitan/peak_flops.json``. A number measured while other jobs loaded the machine is too low,
and a peak too low withholds MFU (MFU over 100%) on every later run of that shape: one cache held
1.48 GFLOP/s for a shape whose neighbours held 180-200. So a number, read or just measured, is kept only
if it is plausible (`why_implausible`):

* below `CEILING_PER_THREAD` times the thread count: no CPU core computes faster;
* at least 1/`NEIGHBOUR_RATIO` of the median of its neighbours whose largest GEMM is no larger: the
  entries with the same CPU, threads, dtype, torch, kernels and method but other GEMM shapes. A larger
  GEMM runs about as fast or faster (its fixed costs spread over more FLOPs), so a shape measured far
  below smaller ones was measured on a busy machine. Larger shapes are no bound: they may be
  legitimately much faster (bf16 on AMX: 381 against 1275 GFLOP/s on one machine).

Why 4: in one shared machine's cache (41 entries: fp32 and bf16, 1 and 2 threads, oneDNN on and off,
every shape the tests train), each entry lay at 0.38-1.8x the median of its neighbours with no larger
GEMMs, except one measured on a busy machine at 0.10x (33 against 333 GFLOP/s); the 1.48 GFLOP/s above
lay at 0.008x. A number that passes but is still too low shows as MFU over 100% in a run, which then
drops its entry (`drop_entry`), so the next run measures again.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

NEIGHBOUR_RATIO = 4.0
# Over twice any CPU core's GEMM peak: Intel AMX's bf16 tiles do 1024 FLOP/cycle, 4 TFLOP/s at 4 GHz.
CEILING_PER_THREAD = 10e12
_GEMMS = "|gemms="


@dataclass(frozen=True)
class CacheEntry:
    """Where a measured peak is cached: the file and the entry's key."""

    path: Path
    key: str


def cache_path() -> Path:
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(cache_home) / "torchtitan" / "peak_flops.json"


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_cache_key(method: str, dtype: torch.dtype, gemms: Iterable[tuple[str, int, int, int]]) -> str:
    """What was measured (`method`, e.g. the fastest GEMM's FLOP/s over 3 passes) and everything it depends on.

    A stale entry (other threads, shapes, torch, kernels, or a number measured another way) never matches.
    """
    shapes = ",".join(f"{layout}{m}x{k}x{n}" for layout, m, k, n in gemms)
    # The kernels a GEMM gets: ATen's SIMD level (ATEN_CPU_CAPABILITY may lower it) and oneDNN on/off.
    kernels = f"isa={torch.backends.cpu.get_cpu_capability()}|onednn={torch.backends.mkldnn.enabled}"
    return (
        f"{method}|{cpu_model_name()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}|{kernels}"
        f"{_GEMMS}{shapes}"
    )


def why_implausible(key: str, value: object, entries: dict[str, object], *, threads: int) -> str | None:
    """Why `value`, measured for `key`, is not to be believed; None if it is plausible (see the module doc)."""
    if not _is_rate(value):
        return f"{value!r} is not a positive number"
    if value > threads * CEILING_PER_THREAD:
        ceiling = f"{threads} x {CEILING_PER_THREAD / 1e12:.0f} TFLOP/s"
        return f"{value / 1e9:.4g} GFLOP/s is above {ceiling}, more than any CPU does at {threads} threads"
    prefix, size = key.rpartition(_GEMMS)[0], _largest_gemm(key)
    smaller = [
        v
        for k, v in entries.items()
        if k != key and k.rpartition(_GEMMS)[0] == prefix and _largest_gemm(k) <= size and _is_rate(v)
    ]
    if not smaller:
        return None
    median = statistics.median(smaller)
    if value >= median / NEIGHBOUR_RATIO:
        return None
    return (
        f"{value / 1e9:.4g} GFLOP/s is under 1/{NEIGHBOUR_RATIO:.0f} of the {median / 1e9:.4g} GFLOP/s that "
        f"{len(smaller)} entries with no larger GEMMs hold"
    )


def _is_rate(value: object) -> bool:
    # bool is an int in Python, and JSON may hold NaN or Infinity
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _largest_gemm(key: str) -> int:
    """The multiply-adds of the largest GEMM a key names (0 for a key without shapes)."""
    shapes = re.findall(r"(\d+)x(\d+)x(\d+)", key.rpartition(_GEMMS)[2])
    return max((int(m) * int(k) * int(n) for m, k, n in shapes), default=0)


def read_cache(path: Path) -> tuple[dict[str, object], str | None]:
    """The cache's entries, and why the file was unreadable (then no entries); a missing file is empty."""
    if not path.exists():
        return {}, None
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {}, f"the file is unreadable ({e})"
    if not isinstance(entries, dict):
        return {}, "the file is not a JSON object"
    return entries, None


def write_cache(path: Path, entries: dict[str, object]) -> str | None:
    """Write `entries` to `path`; why that failed, or None."""
    # Write to a temp file and rename so that concurrent ranks never read a half-written file.
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            tmp_name = f.name
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp_name, path)
    except OSError as e:
        if tmp_name is not None and os.path.exists(tmp_name):
            os.remove(tmp_name)
        return f"could not write {path} ({e})"
    return None


def drop_entry(entry: CacheEntry, flops: float) -> bool:
    """Remove `entry` if it still holds `flops` (another run may have measured it again since); whether it did."""
    entries, problem = read_cache(entry.path)
    if problem is not None or entries.get(entry.key) != flops:
        return False
    del entries[entry.key]
    return write_cache(entry.path, entries) is None
