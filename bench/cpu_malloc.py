"""``training.cpu_malloc``: the trainer with glibc's malloc defaults against the tuned thresholds, on CPU.

The setting is process-wide, so each run is a launch of its own (``run_llama_train.sh``, compare.sh's settings:
the debug model, fp32, no AC, seq 256, batch 8), alternating ``system`` and ``tuned`` (which goes first flips each
round); per run the median tokens/s over steps 5-30 and the launch's minor page faults (all its processes', start to end,
from ``getrusage(RUSAGE_CHILDREN)``). Prints one JSON object; ratio = tuned / system, the median of the rounds'.

    python -m bench.cpu_malloc [--rounds 4] [--nproc 1] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ["--training.seq_len", "256", "--training.batch_size", "8", "--training.mixed_precision_param", "float32"]
SETTINGS += ["--activation_checkpoint.mode", "none", "--training.warmup_steps", "5", "--metrics.log_freq", "1"]


def one_run(mode: str, nproc: int, steps: int, folder: Path) -> dict:
    args = [*SETTINGS, "--training.steps", str(steps), "--training.data_parallel_shard_degree", str(nproc)]
    args += ["--job.dump_folder", str(folder), "--training.cpu_malloc", mode]
    env = {**os.environ, "NGPU": str(nproc), "PYTHON": sys.executable}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    done = subprocess.run(["./run_llama_train.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
    if done.returncode != 0:
        raise SystemExit(f"error: the {mode} run exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tps"] for r in records if "tps" in r and 5 <= r["step"] <= steps]
    return {"tps": statistics.median(tps), "launch_faults": faults, "loss": records[-1]["loss"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=1, help="ranks (FSDP2 over all of them)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"system": [], "tuned": []}
    with tempfile.TemporaryDirectory(prefix="bench_cpu_malloc_") as scratch:
        for r in range(args.rounds):
            for mode in ("system", "tuned") if r % 2 == 0 else ("tuned", "system"):
                runs[mode].append(one_run(mode, args.nproc, args.steps, Path(scratch) / f"{mode}_{r}"))
    ratios = [t["tps"] / s["tps"] for s, t in zip(runs["system"], runs["tuned"])]
    report = {
        "benchmark": "cpu_malloc",
        "nproc": args.nproc,
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        **{f"{mode}_tps": [run["tps"] for run in v] for mode, v in runs.items()},
        **{f"{mode}_launch_faults": statistics.median(run["launch_faults"] for run in v) for mode, v in runs.items()},
        "losses_equal": all(s["loss"] == t["loss"] for s, t in zip(runs["system"], runs["tuned"])),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
