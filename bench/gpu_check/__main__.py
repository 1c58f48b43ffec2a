"""One command that checks the trainer on one GPU: numerics, throughput, float8, attention, the memory
estimator, the model families, the compiled rows, RL and the asynchronous checkpoint, within a time budget, and
reports what it saw.

    cd <repo> && python -m bench.gpu_check --out OUT [--budget_s 420]
    python -m bench.gpu_check --section levers --out OUT [--budget_s 540]     # the MFU levers, on and off (9)
    python -m bench.gpu_check --section width_8b --out OUT [--budget_s 540]   # 8B width, bf16 and float8 (9b)
    python -m bench.gpu_check --cpu-dry-run --out OUT     # tiny shapes on the CPU (CI)

(From the repository root: ``-m`` puts it on the path, so neither torchtitan nor this package needs installing.)

Prints progress to stderr, the final JSON to stdout, and keeps OUT/gpu_check.json and OUT/gpu_check.md (one
markdown table) up to date after every section, so a killed check still leaves its results. Sections, in
the order they run (each inside its own try/except; a run starts only if the budget has its expected cost
left, else it is recorded as skipped for the time budget):

1. environment: GPU, driver, torch, CUDA, packages, the bf16 peak MFU divides by.
2. sanity: the fp32 debug model's first 5 losses here vs in a CPU-only child process, same weights (1e-4).
3. throughput: Llama 3.2 1B shape, bf16, seq 2048 eager then compile, seq 8192 eager: tokens/s, MFU
   (the trainer's own FLOPs and peak), peak memory (``torch.accelerator.max_memory_allocated``); the compiled
   row's step broken down from the profiler (GEMMs, attention, norms, loss, optimizer, casts, gaps: breakdown.py).
4. estimator: ``estimate_memory`` (fake tensors) vs the real steps' peak, 1B seq 2048 without and with full
   AC (target: within 5%).
5. attention: block_causal with 'auto' (FlexAttention on CUDA) vs causal SDPA vs block_causal 'sdpa', same
   tokens (documents of 256-2048 tokens): tokens/s and the step-by-step loss differences.
6. float8: tensorwise and rowwise vs bf16, compiled; skipped with a note where torchao is not installed.
7. families: gpt_oss and deepseek_v3 debug flavors, 10 steps each; qwen3_5_vl's with random images (packed samples,
   block_causal); transformers' Llama (``model.name = "hf"``, llama_tiny): finite losses.
7b. linear_attention: Qwen3.5 (0.8B shape, seq 4096) with Gated DeltaNet's torch chunked rule, then with
   flash-linear-attention's kernel where installed (``pip install -e '.[fla]'``; else skipped with the kernel key's
   one-line refusal):
   tokens/s and the step-by-step loss difference.
8. features: Muon with the no-decay preset, step replay every 2nd step (deterministic), LoRA rank 16 with full
   AC: finite losses, and a replay that finds the same numbers twice (a mismatch stops the run: an error).
8a. compile: the 1B compiled row with ``training.cuda_graphs`` against it; Qwen3-MoE and DeepSeek-V3 (debug flavors,
   seq 2048) compiled against eager; Qwen3.5 0.8B compiled against the linear_attention section's torch row. A row
   the pre-launch check refuses here (CUDA graphs off CUDA) is skipped with its one line.
8b. rl: a GRPO step of train_configs/grpo_arith.toml (its tokenizer and prompts): generation and update tokens/s as
   the trainer logs them.
8c. checkpoint: the 1B eager row saving asynchronously into pinned memory (checkpoint.async_mode =
   'async_with_pinned_mem') against the same row without: tokens/s ratio, seconds each save blocked training.
9. levers (``--section levers``: run with the environment alone, its own budget; the dry run always runs it): the 1B
   compiled seq-2048 row, then pure bf16 (``training.dtype = "bfloat16"``) with the chunked loss (512 positions
   a chunk), fused AdamW with the chunked loss (pure bf16 refuses fused), then each alone: tokens/s, MFU, peak
   memory, the step's breakdown, and the loss difference of each against the base row (issue 57's levers, on and
   off in one invocation).
9b. width_8b (``--section width_8b``, likewise apart; the dry run runs it with one tiny block): Llama 3 8B's width
   (dim 4096, FFN 14,336, 32 heads, 8 KV heads, 128K vocabulary) at 8 blocks (``RunSpec.n_layers``), compiled,
   seq 8192, batch 1: MFU in bf16, then float8 tensorwise and rowwise against it (skipped without torchao).
10. if time allows (added to throughput): 1B compile at seq 8192, then the 3B shape (full AC).

Every run is the trainer itself (``torchtitan.train.Trainer`` through its ``Builders`` seam (engine/builders.py), as the
memory estimator builds it) on seeded random tokens, one process, world size 1: see bench/gpu_check/runs.py.

Packages: torch (2.11 or newer), numpy, tiktoken, tokenizers, safetensors, transformers; nothing is installed.
Not needed: datasets, torchdata, torchft, pytest. Optional: torchao, for the float8 section (skipped with a
note without it). To carry it to a machine without network, unpack a torchao wheel built for that machine's
torch (torchao 0.17.0 for torch 2.11; a wheel is a zip file) into an ignored folder and put it on the path:
``python -m zipfile -e torchao-0.17.0-cp310-abi3-*.whl .whl/torchao`` and then
``PYTHONPATH=.whl/torchao python -m bench.gpu_check --out OUT --budget_s 560``.

``--cpu-dry-run``: the same sections and code with tiny shapes (debugmodel_tiny, seq 64-128) on the CPU,
hiding any GPU; one compile (of the tiny model) instead of two. tests/runs/launch/test_gpu_check.py runs it.

Golden files (bench/gpu_check/golden.py): every run row's tokens/s and peak memory are compared with
bench/golden/<kind>.json, the kind named from the GPU (h100, h200, ...; ``cpu_dry_run`` for the dry run). Each
row gets a verdict (ok / REGRESSED / improved / new row / config changed / not measured), the report ends with
one line naming every regressed row, and a kind with no file says so in that line. A regression leaves the exit
code as it is unless ``--fail-on-regression`` (then 4), so a GPU session always gets every result.
``--record-golden`` writes this run's rows into the kind's file (rows it did not measure are kept).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

# golden.py and report.py import no torch: safe before CUDA_VISIBLE_DEVICES is set
from bench.gpu_check import golden as goldens
from bench.gpu_check.report import Report

GPU_BUDGET_S = 420.0
DRY_RUN_BUDGET_S = 300.0  # a bound, not a target: the dry run takes well under a minute on 2 cores
GRACE_S = 90.0  # past the budget, the watchdog writes what there is and exits
# Sections a GPU run leaves out (each fills a budget of its own; the dry run runs them): what to run instead.
APART = {
    "levers": "six compiled 1B runs",
    "width_8b": "three compiled runs at 8B width",
}
EXIT_REGRESSED = 4  # with --fail-on-regression: every section ran, a row regressed against the golden file


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="./gpu_check_out", help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--budget_s", type=float, default=None, help=f"time budget (default {GPU_BUDGET_S:.0f} s)")
    p.add_argument("--grace_s", type=float, default=GRACE_S, help="hard stop this long after the budget")
    p.add_argument("--cpu-dry-run", dest="cpu_dry_run", action="store_true", help="tiny shapes on the CPU")
    p.add_argument(
        "--section",
        choices=sorted(APART),
        default=None,
        help="run the environment and this section alone (a default GPU run leaves both out: each fills a budget; "
        "the dry run runs both at tiny shapes). levers: 1B compiled at seq 2048 with fused AdamW, the chunked loss "
        "and pure bf16, in the sets that compose and each alone. width_8b: Llama 3 8B's width at 8 blocks, "
        "compiled at seq 8192, in bf16 and with each float8 recipe",
    )
    p.add_argument(
        "--golden-dir", dest="golden_dir", default=None, help="where the golden files are (default bench/golden)"
    )
    p.add_argument(
        "--record-golden",
        dest="record_golden",
        action="store_true",
        help="write this run's rows into the device kind's golden file (rows not measured are kept)",
    )
    p.add_argument(
        "--fail-on-regression",
        dest="fail_on_regression",
        action="store_true",
        help=f"exit {EXIT_REGRESSED} if a row regressed against the golden file (default: the exit code ignores it)",
    )
    p.add_argument("--reference_run", default=None, help=argparse.SUPPRESS)  # the sanity section's CPU child
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_dry_run:  # set before torch is imported (and inherited by the sanity section's child)
        # no GPU: the package's device choice then picks the CPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        # one thread: on a 2-core machine shared with other jobs, OpenMP's two spinning threads made a
        # tiny step 70x slower (measured at load 7: 1.75 s vs 0.024 s a step)
        os.environ["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[gpu_check {time.perf_counter() - start:7.1f} s] {message}", file=sys.stderr, flush=True)

    log("importing torch and torchtitan")
    from bench.gpu_check import plan as gpu_plans  # imported here, after CUDA_VISIBLE_DEVICES is set
    from bench.gpu_check import sections

    plan = gpu_plans.dry_run_plan() if args.cpu_dry_run else gpu_plans.gpu_plan()
    if args.reference_run is not None:
        sections.write_cpu_reference(plan, Path(args.reference_run))
        return 0
    from torchtitan.distributed.backend.device import get_device_info

    device = get_device_info().device
    if device.type == "cpu" and not args.cpu_dry_run:
        print("error: no GPU found; bench.gpu_check needs one (or pass --cpu-dry-run)", file=sys.stderr)
        return 2
    budget_s = args.budget_s or (DRY_RUN_BUDGET_S if args.cpu_dry_run else GPU_BUDGET_S)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = sections.Context(device, plan, out, sections.Budget(budget_s), log, args.cpu_dry_run)
    golden = _load_golden(device, args)
    log(f"golden file {golden.path}: {'found' if golden.data else golden.error or 'none'}")
    report = run_check(ctx, golden, budget_s + args.grace_s, only=args.section)
    if args.record_golden:
        _record_golden(report, golden, sys.argv[1:] if argv is None else argv, log)
    return _exit_code(report, fail_on_regression=args.fail_on_regression)


def _load_golden(device, args: argparse.Namespace) -> goldens.Golden:
    """The golden file of this device's kind (from the GPU's name; 'cpu_dry_run' for the dry run)."""
    from bench.gpu_check import environment

    kind = goldens.device_kind(environment.gpu_name(device), dry_run=args.cpu_dry_run, device_type=device.type)
    return goldens.load_golden(kind, Path(args.golden_dir) if args.golden_dir else goldens.GOLDEN_DIR)


def _exit_code(report: Report, *, fail_on_regression: bool) -> int:
    """1 if a section failed (the golden file's too: one that does not read); else EXIT_REGRESSED if asked to."""
    if any(s["status"] == "error" for s in report.sections.values()):
        return 1
    return EXIT_REGRESSED if fail_on_regression and report.regressed() else 0


def _record_golden(report: Report, golden: goldens.Golden, argv: list[str], log: Callable[[str], None]) -> None:
    """Write the run's rows into the kind's golden file, with where and how they were measured."""
    from bench.gpu_check.runs import SPEC_KEYS

    if golden.error is not None:  # its tolerances and notes would be lost: the file must be mended by hand
        log(f"golden file {golden.path} not recorded: it does not read ({golden.error}); mend or delete it first")
        return
    env = report.sections["environment"]
    pythonpath = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    meta = {
        "device": env.get("gpu") or f"CPU: {env.get('cpu_model')}, {env.get('cpu_count')} cores (dry run: 1 thread)",
        "torch": env.get("torch"),
        "date": env.get("date"),
        "command": pythonpath + shlex.join(["python", "-m", "bench.gpu_check", *argv]),
        "git_commit": env.get("git_commit"),
        "packages": env.get("packages"),
    }
    data = goldens.record_golden(report.sections, golden, meta=meta, spec_keys=SPEC_KEYS)
    goldens.write_golden(data, golden.path)
    log(f"recorded {len(data['rows'])} rows to {golden.path}")


def run_check(ctx, golden: goldens.Golden, hard_limit_s: float, *, only: str | None = None) -> Report:
    """Every stage in order, each recorded as it ends (its run rows compared with ``golden``); the final JSON on
    stdout. Returns the report. ``only`` (a section of ``APART``): the environment and that section (the others:
    skipped, saying so); without it a GPU run skips the ``APART`` sections and the dry run runs them."""
    import torch

    from bench.gpu_check import environment, features, sections

    torch._dynamo.config.automatic_dynamic_shapes = False  # each seq_len compiles static, as a run of it does
    report = Report(ctx.out, golden)
    watchdog = _start_watchdog(report, ctx, hard_limit_s)
    stages = [
        ("environment", environment.environment),
        ("sanity", sections.sanity),
        ("throughput", sections.throughput),
        ("estimator", sections.estimator),
        ("attention", sections.attention),
        ("float8", sections.float8),
        ("families", features.families),
        ("linear_attention", features.linear_attention),
        ("features", features.features),
        ("compile", features.compiled),
        ("rl", features.rl),
        ("checkpoint", features.checkpoint),
        *((name, getattr(sections, name) if ctx.dry_run else _apart(name)) for name in APART),
        ("throughput", lambda c: sections.more_throughput(c, report.sections["throughput"])),
    ]
    if only is not None:
        stages = [stages[0], (only, getattr(sections, only))]
    for name, stage in stages:
        ctx.log(f"section {name}: start ({ctx.budget.left():.0f} s of the budget left)")
        earlier = report.sections[name]
        report.set(name, {**earlier, "status": "running", "started_at_s": round(ctx.budget.elapsed(), 1)})
        try:
            record = stage(ctx)
        except Exception as e:  # recorded; the next section goes on
            record = sections.error_record(name, e)
        report.set(
            name, {**record, "section_s": round(ctx.budget.elapsed() - report.sections[name]["started_at_s"], 1)}
        )
        ctx.log(f"section {name}: {record['status']} {record.get('error') or record.get('reason') or ''}")
    watchdog.cancel()
    report.finish(f"not run: --section {only} runs the environment and {only} alone" if only else "time budget")
    print(report.to_json())
    ctx.log(report.sections["golden"]["summary"])
    ctx.log(f"done; results in {ctx.out}")
    return report


def _apart(name: str) -> Callable:
    """The stage of an ``APART`` section in a default GPU run: skipped, naming the command that runs it."""
    from bench.gpu_check import sections

    reason = f"run on its own: python -m bench.gpu_check --section {name} --out OUT ({APART[name]} fill a budget)"
    return lambda ctx: sections.skipped(name, reason)


def _start_watchdog(report, ctx, limit_s: float) -> threading.Timer:
    """Past ``limit_s`` (a section stuck past the budget), record the running section as stopped and exit."""

    def stop() -> None:
        for name, record in report.sections.items():
            if record["status"] == "running":
                report.set(name, {**record, "status": "error", "error": f"stopped by the watchdog at {limit_s:.0f} s"})
        report.finish("time budget (the watchdog stopped the check)")
        print(report.to_json(), flush=True)
        ctx.log("watchdog: hard time limit reached; partial results written")
        os._exit(3)

    timer = threading.Timer(limit_s - ctx.budget.elapsed(), stop)
    timer.daemon = True
    timer.start()
    return timer


if __name__ == "__main__":
    sys.exit(main())
