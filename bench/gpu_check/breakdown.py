"""Where a training step's time goes, from torch's profiler: GEMMs, attention, norms, the loss, the optimizer (and
gradient clipping), casts and copies, other kernels, and the gaps where the device runs nothing (issue 57: the
breakdown to read when a row's MFU is short of its target).

On a GPU the profiled steps' CUDA kernels (and memory copies) are bucketed by name, and the gaps are the steps'
wall time less the union of the kernels' intervals: launch gaps, host work and syncs the device waits on. On the
CPU (the dry run) the buckets are the aten ops' self CPU time, and the gaps are the wall time outside any aten op
(Python, the autograd engine, the trainer). A share is of the profiled steps' wall time; the buckets and the gaps
add up to 100% on a GPU (kernels on one stream do not overlap); ``top`` names the kernels that took the most.

Imports no torch at module level: report.py formats a breakdown before CUDA_VISIBLE_DEVICES is set (``__main__``).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

PROFILE_STEPS = 2  # after the timed steps; each profiled row costs these steps and the trace's processing
GAPS = "gaps"
# (bucket, pattern), first match wins: the optimizer before anything its foreach kernels might match, attention
# before GEMMs (attention kernels run GEMMs inside), the loss and norms before other fused kernels.
_BUCKETS = (
    ("optimizer", r"adam|multi_tensor_apply|_foreach_|lerp|addcdiv|addcmul"),
    ("attention", r"flash|fmha|attention|sdpa|flex"),
    ("loss", r"log_softmax|softmax|nll_loss|cross_entropy"),
    ("gemm", r"gemm|gemv|cutlass|xmma|nvjet|cublas|^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|_int_mm)$"),
    ("norm", r"rsqrt|rms_norm|layer_norm"),
    ("cast/copy", r"copy|cast|convert|memcpy|memset|^aten::(to|clone|contiguous|fill_|zero_)$"),
    ("collective", r"nccl|all_reduce|allreduce|reduce_scatter|all_gather|gloo"),
)
_COMPILED = re.compile(r"^triton_")  # inductor's fused kernels, not matched above: elementwise and reductions


def bucket(name: str) -> str:
    """The bucket of a CUDA kernel or an aten op, by name."""
    lowered = name.lower()
    for label, pattern in _BUCKETS:
        if re.search(pattern, lowered):
            return label
    return "fused (compiled)" if _COMPILED.match(lowered) else "other"


def profile_steps(trainer: Any, steps: int = PROFILE_STEPS) -> dict[str, Any]:
    """``steps`` more training steps under the profiler, and where their time went (``summarize``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from torchtitan.distributed.backend.device import synchronize

    device = trainer.device
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            trainer.run_step()
        synchronize(device)
        wall_s = time.perf_counter() - start
    events = prof.events()
    if on_gpu:
        spans = [(e.name, e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
        return summarize(spans, wall_s, steps, source="CUDA kernels", union=True)
    ops = [(e.name, 0.0, float(e.self_cpu_time_total)) for e in events if e.name.startswith("aten::")]
    return summarize(ops, wall_s, steps, source="aten ops, self CPU time", union=False)


def summarize(
    spans: Iterable[tuple[str, float, float]], wall_s: float, steps: int, *, source: str, union: bool
) -> dict[str, Any]:
    """Seconds per step and share of the wall time per bucket, the gaps, and the 8 names that took the most.

    ``spans``: (name, start, end) in microseconds. ``union``: the busy time is the union of the intervals (kernels
    on a device); else their sum (self times, which never overlap on one thread)."""
    spans = list(spans)
    by_bucket: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for name, start, end in spans:
        by_bucket[bucket(name)] += end - start
        by_name[name] += end - start
    busy_us = _union_us([(s, e) for _, s, e in spans]) if union else sum(by_bucket.values())
    wall_us = wall_s * 1e6
    seconds = {label: us / 1e6 / steps for label, us in sorted(by_bucket.items(), key=lambda kv: -kv[1])}
    seconds[GAPS] = max(0.0, wall_us - busy_us) / 1e6 / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {
        "source": source,
        "steps": steps,
        "step_s": round(wall_s / steps, 6),
        "seconds_per_step": {k: round(v, 6) for k, v in seconds.items()},
        "share_pct": {k: round(100 * v * steps / wall_s, 1) for k, v in seconds.items()},
        "top": [
            {"name": name[:120], "bucket": bucket(name), "s_per_step": round(us / 1e6 / steps, 6)} for name, us in top
        ],
    }


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def describe(breakdown: dict[str, Any]) -> str:
    """One line for the markdown table: 'gemm 61%, attention 12%, ..., gaps 5%' (buckets of 1% or more)."""
    shares = breakdown["share_pct"]
    return ", ".join(f"{label} {pct:g}%" for label, pct in shares.items() if pct >= 1 or label == GAPS)
