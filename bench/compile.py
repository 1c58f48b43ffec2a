"""training.compile per model family on this CPU: eager vs compiled tokens/s, the compile's first step, the loss gap.

Each family trains twice through the launcher a user types (``python -m torchtitan.train``, one process, the
family's debug config, the same seed and data): eager, then compiled (the order alternates each round, so the
machine's drift hits both alike). From each run's ``metrics.jsonl`` (one row a step): tokens/s is the median of the
steps after ``--warmup`` (compiled runs pay compilation in their first steps); the first step's seconds; the
largest relative loss gap between the two runs over all steps. Each run compiles cold (an Inductor cache of its
own), as a run on a new machine does. The compile report's lines (``compile: first step
...``, ``compile: N recompiles ...``) give the graphs, graph breaks and recompiles. One JSON line per family;
``speedup`` = compiled / eager tokens/s (median over rounds).

``--memory_budget B [B ...]`` adds rows for ``activation_checkpoint.mode = 'memory_budget'`` on Llama's debug model
(compiled): per budget, the step's peak bytes as torch's memory tracker reads them on the real step
(``torchtitan.estimation.measure``: the tracker the estimator is checked against) and the compiled run's tokens/s,
beside the rows for no AC and full AC. The peak falls with the budget.

    python -m bench.compile [--families llama qwen3_moe deepseek_v3 qwen3_5 hf] [--steps 8] [--rounds 1]
                            [--memory_budget 0 0.5 1] [--quick]

``--quick`` (a CI-sized check that every family still compiles): 3 steps, seq_len 64, one round.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# family -> the debug config it trains with (every family's compile path: dense blocks, MoE blocks around their
# routed experts, Gated DeltaNet layers, a transformers model).
FAMILIES = {
    "llama": "train_configs/debug_model.toml",
    "qwen3_moe": "train_configs/qwen3_moe_debug_model.toml",
    "deepseek_v3": "train_configs/deepseek_v3_debug.toml",
    "gpt_oss": "train_configs/gpt_oss_debug.toml",
    "qwen3_5": "train_configs/qwen3_5_debug.toml",
    "hf": "train_configs/hf_debug.toml",
}
DEFAULT_FAMILIES = ("llama", "qwen3_moe", "deepseek_v3", "qwen3_5", "hf")

_FIRST = re.compile(r"compile: first step ([\d.]+) s \(compilation included\), (\d+) graphs; (.*)$", re.M)
_END = re.compile(r"compile: (\d+) recompiles in the (\d+) steps after the first", re.M)


def _train(config: str, folder: Path, args: argparse.Namespace, extra: list[str]) -> dict:
    """One run through the launcher; its metrics rows and its log."""
    command = [
        sys.executable,
        "-m",
        "torchtitan.train",
        "--job.config_file",
        config,
        "--job.dump_folder",
        str(folder),
        "--training.steps",
        str(args.steps),
        "--training.warmup_steps",
        "2",
        "--training.seq_len",
        str(args.seq_len),
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable_checkpoint",
        "false",
        *extra,
    ]
    # A cache of its own per run: the first step's seconds are a cold compile's, as on a new machine.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor_cache")}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"error: bench.compile: {' '.join(command[2:])} exited {done.returncode}:\n{tail}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"rows": rows, "log": done.stdout + done.stderr, "seconds": seconds}


def _tokens_per_s(run: dict, warmup: int) -> float:
    timed = [row["tps"] for row in run["rows"] if row["step"] > warmup]
    if not timed:
        raise SystemExit(f"error: bench.compile: no step after --warmup {warmup}: raise --steps")
    return statistics.median(timed)


def family_row(name: str, args: argparse.Namespace, scratch: Path) -> dict:
    config = FAMILIES[name]
    eager_tps, compiled_tps, speedups, gaps = [], [], [], []
    first_eager, first_compiled, report, losses = [], [], {}, {}
    for round_ in range(args.rounds):
        order = ("eager", "compiled") if round_ % 2 == 0 else ("compiled", "eager")
        runs = {}
        for mode in order:
            extra = ["--training.compile", "true" if mode == "compiled" else "false"]
            runs[mode] = _train(config, scratch / f"{name}-{mode}-{round_}", args, extra)
        eager, compiled = runs["eager"], runs["compiled"]
        e, c = _tokens_per_s(eager, args.warmup), _tokens_per_s(compiled, args.warmup)
        eager_tps.append(e)
        compiled_tps.append(c)
        speedups.append(c / e)
        first_eager.append(eager["rows"][0]["step_time_s"])
        first_compiled.append(compiled["rows"][0]["step_time_s"])
        gaps.append(
            max(
                abs(a["loss"] - b["loss"]) / abs(a["loss"])
                for a, b in zip(eager["rows"], compiled["rows"], strict=True)
            )
        )
        losses = {mode: [row["loss"] for row in runs[mode]["rows"]] for mode in ("eager", "compiled")}
        first, end = _FIRST.search(compiled["log"]), _END.search(compiled["log"])
        report = {
            "graphs": int(first.group(2)) if first else None,
            "graph_breaks": first.group(3) if first else None,
            "recompiles": int(end.group(1)) if end else None,
        }
    return {
        "family": name,
        "config": config,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "rounds": args.rounds,
        "eager_tokens_per_s": statistics.median(eager_tps),
        "compiled_tokens_per_s": statistics.median(compiled_tps),
        "speedup": statistics.median(speedups),
        "eager_first_step_s": statistics.median(first_eager),
        "compiled_first_step_s": statistics.median(first_compiled),
        "max_loss_rel_gap": max(gaps),
        **report,
        "eager_losses": losses["eager"],  # the last round's
        "compiled_losses": losses["compiled"],
    }


def _tracked_peaks(cases: dict[str, list[str]]) -> dict[str, int]:
    """Each case's real step peak bytes as torch's memory tracker reads them: the trainer's build and two steps under
    the tracker the estimator is checked against (torchtitan.estimation.measure, one process)."""
    with tempfile.TemporaryDirectory(prefix="bench_compile_track_") as folder:
        cases_path, out_path = Path(folder) / "cases.json", Path(folder) / "out.json"
        cases_path.write_text(json.dumps(cases))
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "1",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            "localhost:0",
            "-m",
            "torchtitan.estimation.measure",
            str(out_path),
            str(cases_path),
        ]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise SystemExit(f"error: bench.compile: the tracked steps exited {done.returncode}:\n{tail}")
        (results,) = json.loads(out_path.read_text())
    return {name: int(result["tracker_peak"]) for name, result in results.items()}


def budget_rows(budgets: list[float], args: argparse.Namespace, scratch: Path) -> list[dict]:
    """Llama's debug model: no AC and full AC (eager: the estimator's tracker takes compile only with a budget), then
    each budget (compiled); tracked peak, tokens/s, losses."""
    config = FAMILIES["llama"]
    settings = {
        "none": ["--activation_checkpoint.mode", "none", "--training.compile", "false"],
        "full": ["--activation_checkpoint.mode", "full", "--training.compile", "false"],
    }
    for budget in budgets:
        settings[f"memory_budget {budget:g}"] = [
            "--activation_checkpoint.mode",
            "memory_budget",
            "--activation_checkpoint.memory_budget",
            str(budget),
            "--training.compile",
            "true",
        ]
    common = ["--job.config_file", config, "--training.seq_len", str(args.seq_len)]
    peaks = _tracked_peaks({label: [*common, *extra] for label, extra in settings.items()})
    rows = []
    for label, extra in settings.items():
        run = _train(config, scratch / f"budget-{label.replace(' ', '-')}", args, extra)
        rows.append(
            {
                "family": "llama",
                "activation_checkpoint": label,
                "compiled": extra[-1] == "true",
                "tracked_peak_bytes": peaks[label],
                "tokens_per_s": _tokens_per_s(run, args.warmup),
                "losses": [row["loss"] for row in run["rows"]],
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--families",
        nargs="*",
        choices=sorted(FAMILIES),
        default=list(DEFAULT_FAMILIES),
        help="none: the budget rows only",
    )
    parser.add_argument("--steps", type=int, default=8, help="steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s (compilation's)")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="eager/compiled pairs per family (order alternates)")
    parser.add_argument(
        "--memory_budget", type=float, nargs="*", default=None, help="activation_checkpoint.memory_budget rows"
    )
    parser.add_argument("--quick", action="store_true", help="CI-sized: 3 steps, seq_len 64, one round")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seq_len, args.rounds, args.warmup = 3, 64, 1, 1
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}: tokens/s is read after the warmup")
    with tempfile.TemporaryDirectory(prefix="bench_compile_") as scratch:
        for name in args.families:
            print(json.dumps(family_row(name, args, Path(scratch))), flush=True)
        if args.memory_budget:
            for row in budget_rows(args.memory_budget, args, Path(scratch)):
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
