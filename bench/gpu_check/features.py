"""bench/gpu_check's sections of training runs that must train: the model families, Qwen3.5's linear-attention
kernels, the newer features, the compiled rows (CUDA graphs, the MoE families, Qwen3.5), an RL step and the
asynchronous checkpoint into pinned memory."""

from __future__ import annotations

import math
from typing import Any

from bench.gpu_check.runs import RunSpec
from bench.gpu_check.sections import Context, compare_runs, refusal, runs_section, skipped

# The dry run compiles nothing: inductor's cold compile costs 15-30 s a process on 2 CPU cores (plan.py).
DRY_RUN_NO_COMPILE = "the dry run compiles nothing (inductor's cold compile: 15-30 s a process on the CPU)"


def families(ctx: Context) -> dict[str, Any]:
    """Each family's debug flavor trains its steps; every loss must be finite."""
    return finite_runs(ctx, ctx.plan.families)


def linear_attention(ctx: Context) -> dict[str, Any]:
    """Qwen3.5 with Gated DeltaNet's torch chunked rule vs flash-linear-attention's kernel on the same tokens:
    tokens/s ratio and the largest step-by-step loss difference; the fla row skipped where the kernel key refuses it
    (not CUDA, or the package missing: its own one line)."""
    from torchtitan.models.qwen3_5.kernels import resolve_linear_attention_kernel

    torch_rule, fla_rule = ctx.plan.linear_attention
    runs = [ctx.run(torch_rule)]
    try:
        resolve_linear_attention_kernel("fla", ctx.device.type)
        runs.append(ctx.run(fla_rule))
    except ValueError as e:
        runs.append(skipped(fla_rule.name, str(e)))
    section = runs_section(runs, fla_vs_torch=compare_runs(runs[1], runs[0]))
    return _finite(section, runs)


def features(ctx: Context) -> dict[str, Any]:
    """The newer training features on the device (Muon, parameter groups, step replay, LoRA, ...): finite losses."""
    return finite_runs(ctx, ctx.plan.features)


def compiled(ctx: Context) -> dict[str, Any]:
    """Each compiled row against the row it is compared with, on the same tokens: CUDA graphs against the compiled
    step, an MoE family compiled against eager, Qwen3.5 compiled against eager (tokens/s and memory ratios, the
    largest loss difference). A row the pre-launch check refuses on this device is skipped with its one line (CUDA
    graphs off CUDA); the dry run compiles nothing."""
    runs, comparisons = [], []
    for row, base in ctx.plan.compiled:
        pair = [_compiled_run(ctx, spec) for spec in (row, base)]
        runs += pair
        comparisons.append(compare_runs(*pair))
    return _finite(runs_section(runs, vs=[c for c in comparisons if c]), runs)


def _compiled_run(ctx: Context, spec: RunSpec) -> dict[str, Any]:
    if (reason := refusal(spec, ctx.device, ctx.out / "runs")) is not None:
        return skipped(spec.name, reason)
    if ctx.dry_run and spec.compile:
        return skipped(spec.name, DRY_RUN_NO_COMPILE)
    return ctx.run(spec)


def rl(ctx: Context) -> dict[str, Any]:
    """An RL step (GRPO, train_configs/grpo_arith.toml) trains: finite losses; its record carries the generation and
    update tokens/s as the trainer logs them (``trainer_logged``: medians over the timed steps)."""
    return finite_runs(ctx, ctx.plan.rl)


def checkpoint(ctx: Context) -> dict[str, Any]:
    """Saving asynchronously into pinned host memory against the same run without checkpoints: tokens/s ratio over the
    same timed steps (the save lands in them), and the seconds each save blocked training and the write's wait at
    the end (the row's ``checkpoint`` record)."""
    runs, comparisons = [], []
    for row, base in ctx.plan.checkpoint:
        pair = [ctx.run(row), ctx.run(base)]
        runs += pair
        comparisons.append(compare_runs(*pair))
    return _finite(runs_section(runs, vs=[c for c in comparisons if c]), runs)


def finite_runs(ctx: Context, specs: list[RunSpec]) -> dict[str, Any]:
    runs = [ctx.run(spec) for spec in specs]
    return _finite(runs_section(runs), runs)


def _finite(section: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``section``, an error if a run's loss is not finite (each run's own ``finite`` flag set)."""
    for r in runs:
        if r["status"] == "ok":
            r["finite"] = all(math.isfinite(x) for x in r["losses"])
    if section["status"] == "ok" and not all(r.get("finite", True) for r in runs):
        section.update(status="error", error="a run's loss is not finite")
    return section
