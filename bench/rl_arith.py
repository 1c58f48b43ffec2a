"""RL after SFT on the shipped arithmetic task: held-out exact match before and after GRPO and DAPO.

1. **SFT** (``bench/sft_arith.py``'s run, or ``--sft_hf`` an export of it): a debugmodel_tiny Llama fine-tuned on the
   chat rows; its held-out exact match is the "before".
2. **RL**, once per algorithm: ``python -m torchtitan.train`` on train_configs/grpo_arith.toml from that export
   (``checkpoint.initial_load_in_hf``), prompts from tests/assets/rl/arith_prompts.jsonl (no held-out pair), reward
   exact match, publishing the last policy as an HF folder (``rl.publish_every``).
3. **Score**: greedy answers to the 44 held-out questions (bench/sft_arith.py's ``score``) from each published policy.

Prints one JSON object: before/after per algorithm, the per-step reward curve, times; ``--plot FILE`` draws the
reward curves (matplotlib, when installed).

    python -m bench.rl_arith [--seed 0] [--sft_hf DIR] [--steps 100] [--temperature 2.5] [--algorithms grpo dapo] [-- trainer flags]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.sft_arith import ASSETS, MAX_NEW_TOKENS, first_questions, generate_script, machine, score
from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.datasets.sft.prompting import chat_prompt_ids

REPO = Path(__file__).resolve().parent.parent
CONFIG = "train_configs/grpo_arith.toml"


def sft(args: argparse.Namespace, base: Path) -> tuple[Path, dict]:
    """The SFT export to start from (bench/sft_arith.py run now unless ``--sft_hf``) and its report."""
    if args.sft_hf:
        return Path(args.sft_hf), {"sft_hf": args.sft_hf}
    out = base / "sft"
    cmd = [sys.executable, "-m", "bench.sft_arith", "--seed", str(args.seed), "--dump_folder", str(out)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"SFT failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    report = json.loads(run.stdout[run.stdout.index("{") :])
    return Path(report["hf_out"]), {k: report[k] for k in ("train_s", "held_out")}


def rl(args: argparse.Namespace, algorithm: str, hf_in: Path, folder: Path) -> tuple[float, list[dict]]:
    """One RL run; its wall time and per-step records."""
    cmd = [
        sys.executable,
        "-m",
        "torchtitan.train",
        "--job.config_file",
        CONFIG,
        "--job.dump_folder",
        str(folder),
        "--training.data_parallel_shard_degree",
        "1",
        "--training.seed",
        str(args.seed),
        "--training.steps",
        str(args.steps),
        "--training.batch_size",
        str(args.prompts * args.group),
        "--rl.algorithm",
        algorithm,
        "--rl.prompts_per_step",
        str(args.prompts),
        "--rl.group_size",
        str(args.group),
        "--optimizer.lr",
        str(args.lr),
        "--rl.temperature",
        str(args.temperature),
        "--rl.publish_every",
        str(args.steps),
        "--checkpoint.initial_load_path",
        str(hf_in),
        "--checkpoint.initial_load_in_hf",
        "--model.tokenizer_path",
        str(ASSETS / "tokenizer"),
        *(["--rl.clip_high", "0.28"] if algorithm == "dapo" else []),
        *args.overrides,
    ]
    start = time.perf_counter()
    print(f"rl_arith: {algorithm}: {args.steps} steps; its log: {folder.parent / f'{algorithm}.log'}", file=sys.stderr)
    with open(folder.parent / f"{algorithm}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if rc != 0:
        sys.exit(f"{algorithm} failed (exit {rc}): {' '.join(cmd)}; see {folder.parent / f'{algorithm}.log'}")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return seconds, [r for r in records if "reward_mean" in r]


def held_out(hf: Path, tokenizer: ChatTokenizer) -> dict:
    questions = first_questions(ASSETS / "arith_val.jsonl")
    longest = max(len(chat_prompt_ids(tokenizer, u, system=s)) for s, u, _ in questions)
    model = generate_script().load_model(
        None, str(hf), longest + MAX_NEW_TOKENS, tokenizer.base.n_words, torch.device("cpu")
    )
    return score(model, tokenizer, questions)


def plot(curves: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, records in curves.items():
        plt.plot([r["step"] for r in records], [r["reward_mean"] for r in records], label=name)
    plt.xlabel("step")
    plt.ylabel("mean reward (exact match)")
    plt.legend()
    plt.savefig(path, dpi=100)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="SFT's and RL's seed")
    p.add_argument("--sft_hf", default="", help="an HF export of bench/sft_arith.py's run (skips the SFT)")
    p.add_argument("--steps", type=int, default=100, help="RL steps per algorithm")
    p.add_argument("--prompts", type=int, default=8, help="rl.prompts_per_step")
    p.add_argument("--group", type=int, default=16, help="rl.group_size")
    p.add_argument("--lr", type=float, default=1e-4, help="optimizer.lr")
    p.add_argument(
        "--temperature",
        type=float,
        default=2.5,
        help="rl.temperature: the SFT policy is so peaked that at 1.0 most groups sample one answer (no advantage)",
    )
    p.add_argument("--algorithms", nargs="+", default=["grpo", "dapo"], choices=["grpo", "dapo"])
    p.add_argument("--plot", default="", help="write the reward curves here (PNG)")
    p.add_argument("--dump_folder", default="/tmp/torchtitan_bench_rl_arith", help="emptied first")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="after --: trainer flags")
    args = p.parse_args()
    args.overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    return args


def main() -> int:
    args = parse_args()
    start = time.perf_counter()
    base = Path(args.dump_folder)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    hf_in, sft_report = sft(args, base)
    tokenizer = ChatTokenizer(str(ASSETS / "tokenizer"))
    before = held_out(hf_in, tokenizer)
    report = {
        "benchmark": "rl_arith",
        **machine(),
        "settings": {k: v for k, v in vars(args).items() if k != "dump_folder"},
        "sft": sft_report,
        "before": before,
        "runs": {},
    }
    curves = {}
    for algorithm in args.algorithms:
        folder = base / algorithm
        seconds, records = rl(args, algorithm, hf_in, folder)
        curves[algorithm] = records
        after = held_out(folder / "policy" / f"step-{args.steps}", tokenizer)
        report["runs"][algorithm] = {
            "train_s": round(seconds, 1),
            "after": after,
            "reward_curve": [round(r["reward_mean"], 3) for r in records],
            "accuracy_curve": [round(r["accuracy"], 3) for r in records],
            "dropped_groups": [int(r["dropped_groups"]) for r in records],
        }
    if args.plot:
        plot(curves, args.plot)
    report["total_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
