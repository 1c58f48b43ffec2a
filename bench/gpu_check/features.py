"""bench/gpu_check's sections of training runs that must train: the model families and the newer features."""

from __future__ import annotations

import math
from typing import Any

from bench.gpu_check.runs import RunSpec
from bench.gpu_check.sections import Context, runs_section


def families(ctx: Context) -> dict[str, Any]:
    """Each family's debug flavor trains its steps; every loss must be finite."""
    return finite_runs(ctx, ctx.plan.families)


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
