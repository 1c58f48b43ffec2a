"""bench/gpu_check's sections of training runs that must train: the model families, Qwen3.5's linear-attention
kernels and the newer features."""

from __future__ import annotations

import math
from typing import Any

from bench.gpu_check.runs import RunSpec
from bench.gpu_check.sections import Context, compare_runs, runs_section, skipped


def families(ctx: Context) -> dict[str, Any]:
    """Each family's debug flavor trains its steps; every loss must be finite."""
    return finite_runs(ctx, ctx.plan.families)


def linear_attention(ctx: Context) -> dict[str, Any]:
    """Qwen3.5 with Gated DeltaNet's torch chunked rule vs flash-linear-attention's kernel on the same tokens:
    tokens/s ratio and the largest step-by-step loss difference; the fla row skipped where it cannot run."""
    from torchtitan.models.qwen3_5.kernels import FLA_INSTALL, fla_installed

    torch_rule, fla_rule = ctx.plan.linear_attention
    runs = [ctx.run(torch_rule)]
    if ctx.device.type != "cuda" or not fla_installed():
        why = "not CUDA" if ctx.device.type != "cuda" else f"flash-linear-attention not installed ({FLA_INSTALL})"
        runs.append(skipped(fla_rule.name, why))
    else:
        runs.append(ctx.run(fla_rule))
    section = runs_section(runs, fla_vs_torch=compare_runs(runs[1], runs[0]))
    if section["status"] == "ok" and not all(math.isfinite(x) for r in runs for x in r.get("losses", [])):
        section.update(status="error", error="a run's loss is not finite")
    return section


def features(ctx: Context) -> dict[str, Any]:
    """The newer training features on the device (Muon, parameter groups, step replay, LoRA, ...): finite losses."""
    return finite_runs(ctx, ctx.plan.features)


def finite_runs(ctx: Context, specs: list[RunSpec]) -> dict[str, Any]:
    runs = [ctx.run(spec) for spec in specs]
    for r in runs:
        if r["status"] == "ok":
            r["finite"] = all(math.isfinite(x) for x in r["losses"])
    section = runs_section(runs)
    if section["status"] == "ok" and not all(r.get("finite", True) for r in runs):
        section.update(status="error", error="a run's loss is not finite")
    return section
