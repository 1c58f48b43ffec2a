"""Float8 vs bf16: the trainer's tokens/s, peak memory and MFU on the same model and layout.

Runs the real trainer (``run_llama_train.sh``, ``NGPU`` processes) once per variant: bf16, then each
float8 recipe, on one config, seed, data, flavor and layout, with ``mixed_precision_param = bfloat16``
and one log per step, and reads each run's metrics.jsonl, so the figures are the trainer's own:
tokens/s per rank and MFU (medians over the steps after the warmup) and peak memory (the largest
per-step peak of the trainer's tracker: the caching allocator's peak active bytes on a GPU, the
process's peak RSS on CPU). With ``--rounds R`` the variants run R times in turn and each figure is
the median over rounds; the tokens/s ratio is the median of the rounds' own ratios, so a change of
machine load between rounds cancels. ``tps_best`` is the fastest timed step: on a machine shared
with other work, load only ever slows a step down, so there it is the steadier figure (as for the CPU
peak in torchtitan/observability/flops.py). Prints one JSON object; ratios are float8 / bf16.

The device is the trainer's one device choice: a GPU where there is one, else CPU, where float8 is
expected to be slower (no float8 GEMM units: ``torch._scaled_mm`` and the casts to float8 run in plain
CPU code). Any arguments after ``--`` go to every run, e.g. a layout.

    python -m bench.float8 [--flavor debugmodel] [--steps 10] [--warmup 3] [--seq_len 256]
        [--batch_size 8] [--recipe tensorwise --recipe rowwise] [--compile] [--ngpu 1] [--rounds 1]
        [--fsdp_float8_all_gather] [-- --training.tensor_parallel_degree 2]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from torchtitan.distributed.backend.device import get_device_info

REPO = Path(__file__).resolve().parent.parent
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def variant_args(name: str, args: argparse.Namespace) -> list[str]:
    """The config flags that make a run ``name``: 'bf16' or 'float8_<recipe>'."""
    if name == "bf16":
        return []
    recipe = name.removeprefix("float8_")
    flags = ["--float8.enable_float8_linear", "--float8.recipe_name", recipe]
    if args.fsdp_float8_all_gather and recipe == "tensorwise":  # torchao has both for tensorwise only
        flags += ["--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp"]
    return flags


def common_args(args: argparse.Namespace, dump_folder: Path) -> list[str]:
    """The flags every variant shares: same model, shapes, dtype and steps; one log (sync) per step."""
    flags = [
        *("--job.dump_folder", str(dump_folder), "--model.flavor", args.flavor),
        *("--training.steps", str(args.warmup + args.steps), "--training.seq_len", str(args.seq_len)),
        *("--training.batch_size", str(args.batch_size), "--training.mixed_precision_param", "bfloat16"),
        *("--metrics.log_freq", "1", "--checkpoint.enable_checkpoint", "false", "--validation.enabled", "false"),
    ]
    return flags + (["--training.compile"] if args.compile else [])


def run_variant(name: str, args: argparse.Namespace, dump_folder: Path) -> list[dict]:
    """Train one variant through run_llama_train.sh; its metrics.jsonl step records (log in bench.log)."""
    shutil.rmtree(dump_folder, ignore_errors=True)
    dump_folder.mkdir(parents=True)
    env = {**os.environ, "NGPU": str(args.ngpu), "LOG_RANK": "0", "CONFIG_FILE": args.config}
    cmd = ["bash", "run_llama_train.sh", *common_args(args, dump_folder), *variant_args(name, args), *args.overrides]
    log = dump_folder / "bench.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        sys.exit(f"{name} run failed (exit {rc}): {' '.join(cmd)}\n--- last lines of {log} ---\n{tail}")
    lines = (dump_folder / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "tps" in r]


def summarize(rounds: list[list[dict]], warmup: int) -> dict:
    """Per round, medians over the timed steps (after ``warmup``) and the largest memory peak."""
    per_round = []
    for records in rounds:
        timed = [r for r in records if r["step"] > warmup]
        mfus = [r["mfu"] for r in timed]
        per_round.append(
            {
                "tps": statistics.median(r["tps"] for r in timed),
                "memory_gib": max(r["memory_gib"] for r in timed),
                # None: the trainer withheld MFU (peak found unreliable; see docs/metrics.md)
                "mfu": None if None in mfus else statistics.median(mfus),
                "step_time_s": statistics.median(r["step_time_s"] for r in timed),
            }
        )
    best = max(r["tps"] for records in rounds for r in records if r["step"] > warmup)
    return {
        "tps": round(statistics.median(r["tps"] for r in per_round), 1),
        "tps_best": round(best, 1),
        "memory_gib": round(max(r["memory_gib"] for r in per_round), 3),
        "mfu": None
        if any(r["mfu"] is None for r in per_round)
        else round(statistics.median(r["mfu"] for r in per_round), 3),
        "step_time_s": round(statistics.median(r["step_time_s"] for r in per_round), 4),
        "tps_per_round": [round(r["tps"], 1) for r in per_round],
    }


def ratios(results: dict[str, dict]) -> dict:
    """float8 / bf16 per recipe: tokens/s as the median of the rounds' ratios (each round ran the
    variants back to back, so a change of machine load between rounds cancels), memory as a ratio."""
    bf16 = results["bf16"]
    out = {}
    for name, r in results.items():
        if name == "bf16":
            continue
        per_round = [f / b for f, b in zip(r["tps_per_round"], bf16["tps_per_round"])]
        out[name.removeprefix("float8_")] = {
            "tps": round(statistics.median(per_round), 3),
            "tps_per_round": [round(x, 3) for x in per_round],
            "tps_best": round(r["tps_best"] / bf16["tps_best"], 3),
            "memory": round(r["memory_gib"] / bf16["memory_gib"], 3),
        }
    return out


def describe_device() -> dict:
    """The device the trainer ran on (its one device choice), named; called after the runs."""
    device = get_device_info().device
    if device.type == "cuda":  # device-choice: naming the GPU, not choosing it
        name, tracker = torch.cuda.get_device_name(device), "caching allocator peak active bytes"
    else:
        name, tracker = platform.processor() or platform.machine(), "process peak RSS (includes the runtime)"
        if Path("/proc/cpuinfo").exists():
            models = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
            name = models[0] if models else name
    return {"device": f"{device.type} ({name})", "memory_tracker": tracker, "threads": torch.get_num_threads()}


def report(args: argparse.Namespace, results: dict[str, dict]) -> dict:
    settings = {k: v for k, v in vars(args).items() if k != "dump_folder"}
    return {
        "benchmark": "float8",
        **describe_device(),
        "world_size": args.ngpu,
        "torch": torch.__version__,
        "torchao": importlib.metadata.version("torchao"),
        "settings": {**settings, "mixed_precision_param": "bfloat16"},
        **results,
        "ratios_float8_over_bf16": ratios(results),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="./train_configs/debug_model.toml", help="the trainer's TOML config")
    p.add_argument("--flavor", default="debugmodel", help="model.flavor, e.g. 1B (Llama 3.2 1B shapes)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps per run (compile, allocator)")
    p.add_argument("--seq_len", "--seq-len", type=int, default=256)
    p.add_argument("--batch_size", "--batch-size", type=int, default=8, help="per data-parallel rank")
    p.add_argument("--recipe", action="append", choices=RECIPES, help="float8 recipe (repeatable)")
    p.add_argument("--compile", action="store_true", help="training.compile for every variant")
    p.add_argument("--ngpu", type=int, default=1, help="processes (NGPU of run_llama_train.sh)")
    p.add_argument("--rounds", type=int, default=1, help="times each variant runs, in turn")
    p.add_argument(
        "--fsdp_float8_all_gather", action="store_true", help="tensorwise: float8 FSDP all-gather + precomputed scales"
    )
    p.add_argument("--dump_folder", default="/tmp/torchtitan_bench_float8", help="one sub-folder per run")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="after --: config flags for every run")
    args = p.parse_args()
    args.recipe = args.recipe or ["tensorwise", "rowwise"]
    args.overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    if min(args.steps, args.ngpu, args.rounds) < 1 or args.warmup < 0:
        p.error("--steps, --ngpu and --rounds must be >= 1, --warmup >= 0")
    return args


def main() -> int:
    args = parse_args()
    names = ["bf16", *(f"float8_{r}" for r in args.recipe)]
    records: dict[str, list[list[dict]]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names:
            records[name].append(run_variant(name, args, Path(args.dump_folder) / f"{name}_round{round_index}"))
    results = {name: summarize(recs, args.warmup) for name, recs in records.items()}
    print(json.dumps(report(args, results), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
