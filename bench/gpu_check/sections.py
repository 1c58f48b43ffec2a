"""The sections of bench/gpu_check: each takes the ``Context`` and returns its JSON record.

A section never raises for a run that fails: each run is recorded on its own (``status`` ok / error /
skipped, with the error's message and traceback tail), and the section's status says whether any failed.
A run starts only if the time budget has its ``cost_s`` left.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.gpu_check.plan import Plan
from bench.gpu_check.runs import GIB, RunSpec, build_config, run
from torchtitan.distributed.backend.device import get_device_info
from torchtitan.estimation.estimate import estimate_memory, estimate_rank
from torchtitan.estimation.fake_trainer import resolve_vocab
from torchtitan.features.float8.float8 import check_float8_runs
from torchtitan.models.common.attention import resolve_attention_backend

SANITY_TOLERANCE = 1e-4  # fp32 losses, device vs CPU (issue 44)
ESTIMATE_TARGET = 0.05  # |estimate - measured| / measured
REFERENCE_FILE, WEIGHTS_FILE = "reference.json", "initial_weights.pt"


class Budget:
    """The time the whole check may take; runs and sections ask it before they start."""

    def __init__(self, total_s: float):
        self.total_s, self.start = total_s, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed()

    def allows(self, cost_s: float) -> bool:
        return self.left() >= cost_s


def error_record(name: str, e: BaseException) -> dict[str, Any]:
    """A failed run or section: its one-line message and the traceback's last lines."""
    tail = traceback.format_exception(type(e), e, e.__traceback__)
    lines = "".join(tail).rstrip().splitlines()
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return {"name": name, "status": "error", "error": f"{type(e).__name__}: {first}"[:500], "traceback": lines[-12:]}


def skipped(name: str, reason: str) -> dict[str, Any]:
    return {"name": name, "status": "skipped", "reason": reason}


def refusal(spec: RunSpec, device: torch.device, dump_folder: Path) -> str | None:
    """The pre-launch check's one line refusing ``spec`` on ``device`` (e.g. CUDA graphs off CUDA), or None."""
    try:
        build_config(spec, dump_folder, device_type=device.type)
    except (ValueError, NotImplementedError) as e:  # ConfigError is a ValueError
        return str(e)
    return None


@dataclass
class Context:
    device: torch.device
    plan: Plan
    out: Path
    budget: Budget
    log: Callable[[str], None]
    dry_run: bool
    results: dict[RunSpec, dict[str, Any]] = field(default_factory=dict)  # by spec: a run another section reuses

    def run(self, spec: RunSpec, **kwargs: Any) -> dict[str, Any]:
        """``spec``'s result: the earlier one if it ran already, else run now (skipped if the budget is short)."""
        if spec in self.results:
            return {**self.results[spec], "reused": True}
        if not self.budget.allows(spec.cost_s):
            return skipped(
                spec.name, f"time budget: {self.budget.left():.0f} s left, the run needs ~{spec.cost_s:.0f} s"
            )
        self.log(f"  run '{spec.name}' (expected ~{spec.cost_s:.0f} s)")
        try:
            result = run(spec, self.device, self.out / "runs", **kwargs)
        except Exception as e:  # recorded; the next run goes on
            result = error_record(spec.name, e)
        self.results[spec] = result
        self.log(f"  run '{spec.name}': {_summary(result)}")
        return result


def _summary(result: dict[str, Any]) -> str:
    if result["status"] != "ok":
        return f"{result['status']}: {result.get('error') or result.get('reason')}"
    tps, mfu, mem = result["tokens_per_s"], result["mfu_pct"], result["peak_memory_gib"]
    return f"ok, {tps} tokens/s, MFU {mfu}%, peak {mem} GiB, {result['wall_s']} s"


def runs_section(runs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A section of runs: 'error' if any run failed, 'skipped' if none of its own ran (a run reused from an
    earlier section is not its own), else 'ok'."""
    own = [r for r in runs if not r.get("reused")]
    section: dict[str, Any] = {"status": "ok"}
    if any(r["status"] == "error" for r in runs):
        failed = next(r for r in runs if r["status"] == "error")
        section = {"status": "error", "error": f"run '{failed['name']}' failed: {failed['error']}"}
    elif own and all(r["status"] == "skipped" for r in own):
        section = {"status": "skipped", "reason": own[0]["reason"]}
    return {**section, **extra, "runs": runs}


# ----------------------------------------------------------------------------------------------- sanity


def sanity(ctx: Context) -> dict[str, Any]:
    """The fp32 debug model's first losses on this device vs on the CPU, from the same initial weights.

    The CPU run is a process of its own that sees no GPU (the package's device choice then picks the CPU);
    it saves its initial weights, which this run loads (the two devices' RNGs draw different inits)."""
    spec, folder = ctx.plan.sanity, ctx.out / "sanity_reference"
    if not ctx.budget.allows(spec.cost_s):
        return skipped(spec.name, f"time budget: {ctx.budget.left():.0f} s left, the check needs ~{spec.cost_s:.0f} s")
    reference = cpu_reference(folder, dry_run=ctx.dry_run, timeout_s=max(30.0, ctx.budget.left()))
    weights = torch.load(folder / WEIGHTS_FILE, map_location="cpu", weights_only=True)
    result = ctx.run(spec, before_training=lambda trainer: trainer.model_parts[0].load_state_dict(weights))
    if result["status"] != "ok":
        return {**result, "cpu_losses": reference["losses"]}
    diffs = [abs(a - b) for a, b in zip(result["losses"], reference["losses"])]
    return {
        "status": "ok",
        "pass": max(diffs) <= SANITY_TOLERANCE,
        "tolerance": SANITY_TOLERANCE,
        "max_abs_diff": max(diffs),
        "device_losses": result["losses"],
        "cpu_losses": reference["losses"],
        "run": result,
    }


def cpu_reference(folder: Path, *, dry_run: bool, timeout_s: float) -> dict[str, Any]:
    """Run the sanity spec in a CPU-only child process (``python -m bench.gpu_check --reference_run``); its record."""
    repo = Path(__file__).resolve().parents[2]  # -m runs the package from the repository root, as the user does
    cmd = [
        sys.executable,
        "-m",
        "bench.gpu_check",
        "--reference_run",
        str(folder),
        *(["--cpu-dry-run"] if dry_run else []),
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the CPU reference run exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return json.loads((folder / REFERENCE_FILE).read_text())


def write_cpu_reference(plan: Plan, folder: Path) -> None:
    """The child's side of ``cpu_reference``: save the initial weights, train, write the losses."""
    device = get_device_info().device
    if device.type != "cpu":
        raise RuntimeError(f"the reference run must see no accelerator (CUDA_VISIBLE_DEVICES=''); it sees {device}")
    folder.mkdir(parents=True, exist_ok=True)

    def save(trainer) -> None:
        torch.save(trainer.model_parts[0].state_dict(), folder / WEIGHTS_FILE)

    result = run(plan.sanity, device, folder / "runs", before_training=save)
    (folder / REFERENCE_FILE).write_text(json.dumps(result, indent=1))


# ----------------------------------------------------------------------------------------------- sections of runs


def throughput(ctx: Context) -> dict[str, Any]:
    return runs_section([ctx.run(spec, profile=spec == ctx.plan.profiled) for spec in ctx.plan.throughput])


def more_throughput(ctx: Context, earlier: dict[str, Any]) -> dict[str, Any]:
    """The throughput section with the if-time-allows rows added after its own."""
    runs = [*earlier.get("runs", []), *(ctx.run(spec) for spec in ctx.plan.if_time_allows)]
    record = runs_section(runs)
    if earlier.get("status") == "error" and record["status"] != "error":  # the first part's own failure stays
        record.update(status="error", error=earlier.get("error"))
    return record


def estimator(ctx: Context) -> dict[str, Any]:
    """The estimator's predicted peak (fake tensors) vs the real steps' peak of the same config."""
    rows = []
    for spec in ctx.plan.estimator:
        if not ctx.budget.allows(spec.cost_s + 30):
            rows.append(skipped(spec.name, f"time budget: {ctx.budget.left():.0f} s left"))
            continue
        try:
            rows.append(_estimate_vs_real(ctx, spec))
        except Exception as e:
            rows.append(error_record(spec.name, e))
    section = runs_section(rows, target_rel_error=ESTIMATE_TARGET)
    section["configs"] = section.pop("runs")
    return section


def _estimate_vs_real(ctx: Context, spec: RunSpec) -> dict[str, Any]:
    config = build_config(spec, ctx.out / "runs")
    start = time.perf_counter()
    predicted = estimate_memory(config, 1).peak
    estimate_s = time.perf_counter() - start
    ctx.log(f"  estimate '{spec.name}': {predicted / GIB:.3f} GiB in {estimate_s:.1f} s")
    if ctx.device.type == "cpu":  # no allocator statistics: torch's MemTracker on the real step instead
        measured = estimate_rank(config, 1, 0, resolve_vocab(config)[0], fake=False).peak
        measured_by = "MemTracker on the real step (the CPU has no allocator statistics)"
    else:
        real = ctx.run(spec)
        if real["status"] != "ok":
            return {**real, "predicted_gib": round(predicted / GIB, 3)}
        measured = real["peak_memory_bytes"]
        measured_by = "torch.accelerator.max_memory_allocated over build + warmup + timed steps"
    rel = (predicted - measured) / measured
    return {
        "name": spec.name,
        "status": "ok",
        "predicted_gib": round(predicted / GIB, 3),
        "measured_gib": round(measured / GIB, 3),
        "measured_by": measured_by,
        "rel_error": round(rel, 4),
        "within_target": abs(rel) <= ESTIMATE_TARGET,
        "estimate_s": round(estimate_s, 1),
    }


def attention(ctx: Context) -> dict[str, Any]:
    """Causal SDPA vs block_causal ('auto': FlexAttention on CUDA) vs block_causal 'sdpa', on the same tokens."""
    runs, kernels = [], {}
    for spec in ctx.plan.attention:
        backend = (
            resolve_attention_backend(spec.attention_backend, ctx.device.type) if spec.mask != "causal" else "sdpa"
        )
        if (spec.mask, backend) in kernels:
            runs.append(skipped(spec.name, f"same kernel as '{kernels[spec.mask, backend]}' on {ctx.device.type}"))
            continue
        kernels[spec.mask, backend] = spec.name
        runs.append(ctx.run(spec))
    causal, block, block_sdpa = runs
    return runs_section(
        runs,
        block_causal_vs_causal=compare_runs(block, causal),
        block_causal_auto_vs_sdpa=compare_runs(block, block_sdpa),
    )


def compare_runs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """Tokens/s and peak-memory ratios a / b, and the largest step-by-step loss difference."""
    if a["status"] != "ok" or b["status"] != "ok":
        return None
    return {
        "runs": [a["name"], b["name"]],
        "tps_ratio": _ratio(a["tokens_per_s"], b["tokens_per_s"]),
        "memory_ratio": _ratio(a["peak_memory_gib"], b["peak_memory_gib"]),
        "loss_max_abs_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _float8_unavailable(device: torch.device) -> str | None:
    """Why float8 cannot run here (no torchao, or a device it does not support), or None."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao not installed (optional: bench/gpu_check/__main__.py's docstring says how to carry it)"
    try:
        check_float8_runs(device)
    except NotImplementedError as e:
        return str(e)
    return None


def float8(ctx: Context) -> dict[str, Any]:
    """Each float8 recipe vs the bf16 run of the same config (the first of the plan's float8 rows)."""
    if (reason := _float8_unavailable(ctx.device)) is not None:
        return {"status": "skipped", "reason": reason}
    runs = [ctx.run(spec) for spec in ctx.plan.float8]
    return runs_section(runs, vs_bf16=[compare_runs(r, runs[0]) for r in runs[1:]])


def width_8b(ctx: Context) -> dict[str, Any]:
    """Llama 3 8B's width (dim 4096, 32 heads, 8 KV heads, FFN 14,336, 128K vocabulary) at a few blocks, compiled:
    MFU in bf16, then each float8 recipe's gain over it (issue 57: to set beside torchtitan's published 8B
    per-GPU figures). The bf16 row runs without torchao; the float8 rows are skipped, saying why."""
    base, *recipes = ctx.plan.width_8b
    reason = _float8_unavailable(ctx.device)
    runs = [ctx.run(base), *(ctx.run(spec) if reason is None else skipped(spec.name, reason) for spec in recipes)]
    return runs_section(runs, vs_bf16=[compare_runs(r, runs[0]) for r in runs[1:]])


def levers(ctx: Context) -> dict[str, Any]:
    """The MFU levers (plan.levers: fused AdamW, the chunked loss, pure bf16; the sets that compose, then each
    alone) on the base row, each compared with it in the same invocation (issue 57: kept only where it helps and
    stays at loss parity, so the loss differences are reported beside the ratios)."""
    base, *rest = (ctx.run(spec, profile=True) for spec in ctx.plan.levers)
    return runs_section([base, *rest], vs_base=[compare_runs(r, base) for r in rest])
