"""Asynchronous rollouts against synchronous ones on the arithmetic task: steps/s, and held-out exact match after N steps.

From one SFT export (``bench/sft_arith.py``'s, or ``--sft_hf``), GRPO on train_configs/grpo_arith.toml runs N steps
at each ``--ranks`` count twice: synchronous (``rl.max_staleness 0``: each step generates, then updates) and
asynchronous (``rl.max_staleness K``: the run's generator process makes step s's rollouts from the policy of step
s - 1 - K while the ranks update). Per run, from its ``metrics.jsonl``: the median step seconds after the first step
(steps/s), its wall time, the rewards, and for the asynchronous runs the logged staleness and overlap; then the
greedy held-out exact match of the last policy (the 44 questions of bench/sft_arith.py's ``score``). One JSON line a
run, then one a rank count with the ratios (async / sync).

On CPU the generator and the ranks share the machine's cores, so the overlap buys less than on a GPU node where the
generator has devices of its own; the runs show what the staleness costs in held-out accuracy at equal steps.

    python -m bench.rl_async [--sft_hf DIR] [--steps 30] [--staleness 1] [--ranks 1 2] [-- trainer flags]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.rl_arith import CONFIG, REPO, held_out, sft
from bench.sft_arith import ASSETS, machine
from torchtitan.datasets.sft.chat_template import ChatTokenizer


def run(args: argparse.Namespace, hf_in: Path, folder: Path, *, ranks: int, staleness: int) -> dict:
    """One GRPO run; its records and times."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    launcher += ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--tee", "3"]
    sequences = args.prompts * args.group
    cmd = [
        *launcher,
        "-m",
        "torchtitan.train",
        *("--job.config_file", CONFIG, "--job.dump_folder", str(folder)),
        *("--training.seed", str(args.seed), "--training.steps", str(args.steps)),
        *("--training.batch_size", str(sequences // ranks), "--rl.algorithm", "grpo"),
        *("--rl.prompts_per_step", str(args.prompts), "--rl.group_size", str(args.group)),
        *("--optimizer.lr", str(args.lr), "--rl.temperature", str(args.temperature)),
        *("--rl.max_staleness", str(staleness), "--rl.publish_every", "1" if staleness else str(args.steps)),
        *("--checkpoint.initial_load_path", str(hf_in), "--checkpoint.initial_load_in_hf"),
        *("--model.tokenizer_path", str(ASSETS / "tokenizer"), "--metrics.log_freq", "1"),
        *args.overrides,
    ]
    start = time.perf_counter()
    log = folder.parent / f"{folder.name}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if rc != 0:
        sys.exit(f"error: bench.rl_async: {folder.name} exited {rc}: see {log}")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "reward_mean" in r]
    step_s = statistics.median(r["step_time_s"] for r in records[1:])
    row = {
        "run": folder.name,
        "ranks": ranks,
        "max_staleness": staleness,
        "steps": args.steps,
        "wall_s": round(wall, 1),
        "step_s_median": step_s,
        "steps_per_s": 1.0 / step_s,
        "reward_first": records[0]["reward_mean"],
        "reward_last": records[-1]["reward_mean"],
    }
    if staleness:
        row["staleness_mean"] = statistics.mean(r["staleness_mean"] for r in records)
        row["overlap_median"] = statistics.median(r["overlap"] for r in records[1:])
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft_hf", default="", help="an HF export of bench/sft_arith.py's run (skips the SFT)")
    p.add_argument("--steps", type=int, default=30, help="RL steps per run")
    p.add_argument("--staleness", type=int, default=1, help="rl.max_staleness of the asynchronous runs")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="process counts (FSDP over them)")
    p.add_argument("--prompts", type=int, default=8, help="rl.prompts_per_step")
    p.add_argument("--group", type=int, default=8, help="rl.group_size")
    p.add_argument("--lr", type=float, default=1e-4, help="optimizer.lr")
    p.add_argument("--temperature", type=float, default=2.5, help="rl.temperature")
    p.add_argument("--dump_folder", default="/tmp/torchtitan_bench_rl_async", help="emptied first")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="after --: trainer flags")
    args = p.parse_args()
    args.overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    if args.staleness < 1:
        p.error(f"--staleness {args.staleness}: the asynchronous runs need rl.max_staleness >= 1")
    base = Path(args.dump_folder)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    hf_in, _ = sft(args, base)
    tokenizer = ChatTokenizer(str(ASSETS / "tokenizer"))
    print(json.dumps({"benchmark": "rl_async", **machine(), "before": held_out(hf_in, tokenizer)}), flush=True)
    for ranks in args.ranks:
        rows = {}
        for staleness in (0, args.staleness):
            folder = base / f"ranks{ranks}_staleness{staleness}"
            rows[staleness] = run(args, hf_in, folder, ranks=ranks, staleness=staleness)
            rows[staleness]["held_out"] = held_out(folder / "policy" / f"step-{args.steps}", tokenizer)
            print(json.dumps(rows[staleness]), flush=True)
        sync, late = rows[0], rows[args.staleness]
        print(
            json.dumps(
                {
                    "ranks": ranks,
                    "async_over_sync_steps_per_s": late["steps_per_s"] / sync["steps_per_s"],
                    "async_over_sync_wall": late["wall_s"] / sync["wall_s"],
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
