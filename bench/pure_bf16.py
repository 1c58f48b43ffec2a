"""Pure bf16 training (training.dtype = "bfloat16") against mixed precision and fp32, on the debug model.

Four trainer runs of the same steps, seed and data, one after another (one process, --threads threads):

* fp32: fp32 weights, fp32 compute (the reference curve);
* mixed: fp32 weights, bf16 compute (training.mixed_precision_param = "bfloat16": autocast);
* pure: bf16 weights, gradients and Adam moments (training.dtype = "bfloat16"), updates rounded to nearest;
* pure_sr: the same, updates rounded stochastically (optimizer.bf16_stochastic_round).

Per run: the loss curve's gap to fp32 (mean and max relative over the steps, and over the last 50: the
smoothed curves' gap), the median step time past the first 10 steps, the process's peak RSS, and the
estimator's per-rank tensor peak for the same config (estimation.py: equal to the tracker on the real step,
tests/runs/estimation/test_estimation.py). Prints one JSON object; docs/performance.md has the figures.

    python -m bench.pure_bf16 [--steps 200] [--seq_len 256] [--batch_size 8] [--threads 2] [--curves FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from torchtitan.observability.peak_cache import cpu_model_name

MODES = {
    "fp32": ["--training.mixed_precision_param", "float32"],
    "mixed": ["--training.mixed_precision_param", "bfloat16"],
    "pure": ["--training.mixed_precision_param", "bfloat16", "--training.dtype", "bfloat16"],
    "pure_sr": [
        "--training.mixed_precision_param",
        "bfloat16",
        "--training.dtype",
        "bfloat16",
        "--optimizer.bf16_stochastic_round",
    ],
}


def _common(args: argparse.Namespace) -> list[str]:
    return [
        "--job.config_file",
        "./train_configs/debug_model.toml",
        "--training.steps",
        str(args.steps),
        "--training.seq_len",
        str(args.seq_len),
        "--training.batch_size",
        str(args.batch_size),
        "--activation_checkpoint.mode",
        "none",
        "--metrics.log_freq",
        "1",
        "--training.seed",
        "0",
    ]


def _train(argv: list[str], folder: str, threads: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "torchtitan.train", *argv, "--job.dump_folder", folder]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def _estimate_mib(argv: list[str]) -> float:
    from torchtitan.config.manager import JobConfig
    from torchtitan.estimation.estimate import estimate_memory

    return round(estimate_memory(JobConfig.parse_args(argv, world_size=1), 1).peak / 2**20, 2)


def _gap(losses: list[float], ref: list[float]) -> dict[str, float]:
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True)]
    tail = rel[-50:]
    return {
        "mean_rel": round(statistics.mean(rel), 5),
        "max_rel": round(max(rel), 5),
        "last50_mean_rel": round(statistics.mean(tail), 5),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--curves", default=None, help="also write every run's per-step losses to this JSON file")
    args = p.parse_args()
    out: dict = {
        "cpu": cpu_model_name(),
        **{k: getattr(args, k) for k in ("steps", "seq_len", "batch_size", "threads")},
    }
    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, extra in MODES.items():
            argv = [*_common(args), *extra]
            records[mode] = _train(argv, os.path.join(tmp, mode), args.threads)
            out[mode] = {
                "step_s": round(statistics.median(r["step_time_s"] for r in records[mode][10:]), 4),
                "rss_peak_gib": round(max(r["memory_gib"] for r in records[mode]), 3),
                "estimated_peak_mib": _estimate_mib(argv),
                "first_loss": round(records[mode][0]["loss"], 4),
                "last_loss": round(records[mode][-1]["loss"], 4),
                "last50_mean_loss": round(statistics.mean(r["loss"] for r in records[mode][-50:]), 4),
            }
    ref = [r["loss"] for r in records["fp32"]]
    for mode in ("mixed", "pure", "pure_sr"):
        out[mode]["gap_to_fp32"] = _gap([r["loss"] for r in records[mode]], ref)
        out[mode]["step_time_vs_mixed"] = round(out[mode]["step_s"] / out["mixed"]["step_s"], 3)
        out[mode]["estimated_peak_vs_mixed"] = round(
            out[mode]["estimated_peak_mib"] / out["mixed"]["estimated_peak_mib"], 3
        )
    if args.curves:
        with open(args.curves, "w") as f:
            json.dump({m: [r["loss"] for r in rs] for m, rs in records.items()}, f)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
