"""A tool-using policy on the arithmetic task: held-out exact match before and after GRPO with the calculator.

1. **SFT on tool use**: the shipped fine-tuning rows (tests/assets/sft/arith_train.jsonl) rewritten so that each
   assistant answer is preceded by a calculator call and its result: assistant ``<calc>A+B</calc>``, user
   ``<result>C</result>``, assistant ``A plus B is C.`` (the loss is on the assistant turns only: the result is the
   environment's, as in RL). ``bench/sft_arith.py``'s run on those rows, short on purpose (``--sft_steps``), so that
   the policy calls the tool but not always well.
2. **GRPO with the environment**: ``python -m torchtitan.train`` on train_configs/grpo_calc.toml
   (``rl.environment = ShapedCalculatorEnvironment``: a right call earns 0.5) from that export, on one process, publishing the last policy.
3. **Score**: greedy episodes (``CalculatorEnvironment``: exact match alone, up to ``rl.max_turns`` turns) on the 44 held-out questions
   (tests/assets/sft/arith_val.jsonl, pairs neither SFT nor RL sees), before and after: exact match of the final
   answer (the environment's reward), and the share of episodes that called the calculator.

Prints one JSON object.

    python -m bench.rl_calc [--seed 0] [--sft_steps 400] [--steps 300] [--dump_folder /tmp/torchtitan_bench_rl_calc]
        [-- trainer flags for the GRPO run]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.sft_arith import ASSETS, first_questions, generate_script, machine
from torchtitan.components.generation import Sampling
from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.datasets.sft.prompting import chat_stop_ids
from torchtitan.features.rl.environments.episodes import episode_spec, generate_episodes
from torchtitan.features.rl.prompts import PromptSource

REPO = Path(__file__).resolve().parent.parent
CONFIG = "train_configs/grpo_calc.toml"
ENVIRONMENT = "torchtitan.features.rl.environments.calculator:CalculatorEnvironment"
MAX_NEW_TOKENS, MAX_TURNS, SEQ_LEN = 64, 4, 96  # grpo_calc.toml's


def tool_rows(source: Path) -> list[dict]:
    """The SFT rows with a calculator call and its result before each answer."""
    rows = []
    for line in source.read_text().splitlines():
        out = []
        for message in json.loads(line)["messages"]:
            if message["role"] == "assistant":
                a, b = re.findall(r"\d+", out[-1]["content"])[-2:]
                out += [
                    {"role": "assistant", "content": f"<calc>{a}+{b}</calc>"},
                    {"role": "user", "content": f"<result>{int(a) + int(b)}</result>"},
                ]
            out.append(message)
        rows.append({"messages": out})
    return rows


def sft(args: argparse.Namespace, base: Path) -> tuple[Path, dict]:
    data = base / "calc_sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in tool_rows(ASSETS / "arith_train.jsonl")))
    cmd = [sys.executable, "-m", "bench.sft_arith", "--seed", str(args.seed), "--steps", str(args.sft_steps)]
    cmd += ["--lr", str(args.sft_lr), "--dump_folder", str(base / "sft"), "--", "--training.dataset_path", str(data)]
    cmd += ["--training.seq_len", "192"]  # a two-question tool conversation is ~150 tokens
    print(f"rl_calc: SFT {args.sft_steps} steps on {data}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"SFT failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    report = json.loads(run.stdout[run.stdout.index("{") :])
    return Path(report["hf_out"]), {"train_s": round(time.perf_counter() - start, 1), "steps": args.sft_steps}


def grpo(args: argparse.Namespace, hf_in: Path, folder: Path) -> tuple[float, list[dict]]:
    cmd = [sys.executable, "-m", "torchtitan.train", "--job.config_file", CONFIG, "--job.dump_folder", str(folder)]
    cmd += ["--training.data_parallel_shard_degree", "1", "--training.batch_size", str(args.prompts * args.group)]
    cmd += ["--training.seed", str(args.seed), "--training.steps", str(args.steps), "--optimizer.lr", str(args.lr)]
    cmd += ["--rl.prompts_per_step", str(args.prompts), "--rl.group_size", str(args.group)]
    cmd += ["--rl.temperature", str(args.temperature), "--rl.publish_every", str(args.steps)]
    cmd += ["--checkpoint.initial_load_path", str(hf_in), "--checkpoint.initial_load_in_hf", *args.overrides]
    print(f"rl_calc: GRPO {args.steps} steps; its log: {folder}.log", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with open(f"{folder}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"GRPO failed (exit {rc}): {' '.join(cmd)}; see {folder}.log")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return time.perf_counter() - start, [r for r in records if "reward_mean" in r]


def held_out(hf: Path, tokenizer: ChatTokenizer, val: Path) -> dict:
    """Greedy episodes with the calculator on the held-out questions: exact match, tool use, a few misses."""
    prompts = PromptSource(str(val), tokenizer, seed=0, per_step=1, group_size=1, max_new_tokens=MAX_NEW_TOKENS,
                           seq_len=SEQ_LEN)  # fmt: skip
    rl = SimpleNamespace(environment=ENVIRONMENT, max_new_tokens=MAX_NEW_TOKENS, max_turns=MAX_TURNS)
    spec = episode_spec(rl, prompts, chat_stop_ids(tokenizer))
    model = generate_script().load_model(None, str(hf), SEQ_LEN, tokenizer.base.n_words, torch.device("cpu"))
    exact = called = 0
    misses = []
    for prompt in prompts.prompts:
        (episode,), error = generate_episodes(
            model, prompt, spec, group_size=1, sampling=Sampling(), seed=0, device=torch.device("cpu"), where="bench"
        )
        assert error is None, error
        exact += episode.reward == 1.0
        called += any(episode.env_mask)
        if episode.reward != 1.0 and len(misses) < 3:
            text = tokenizer.base.model.decode(episode.ids, skip_special_tokens=False)
            misses.append({"answer": prompt.row["answer"], "episode": text})
    n = len(prompts.prompts)
    return {"exact": f"{exact}/{n}", "exact_rate": round(exact / n, 3), "tool_calls": f"{called}/{n}", "misses": misses}


def val_prompts(base: Path) -> Path:
    """The held-out questions as RL prompt rows (their first question, system message kept, with its answer)."""
    path = base / "calc_val.jsonl"
    rows = []
    for system, user, answer in first_questions(ASSETS / "arith_val.jsonl"):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        rows.append({"messages": messages, "answer": answer})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="SFT's and GRPO's seed")
    p.add_argument("--sft_steps", type=int, default=400, help="SFT steps on the tool rows (short: a partial policy)")
    p.add_argument("--sft_lr", type=float, default=3e-3)
    p.add_argument("--sft_hf", default="", help="an HF export of an earlier run's SFT (skips the SFT)")
    p.add_argument("--steps", type=int, default=300, help="GRPO steps")
    p.add_argument("--prompts", type=int, default=8, help="rl.prompts_per_step")
    p.add_argument("--group", type=int, default=8, help="rl.group_size")
    p.add_argument("--lr", type=float, default=5e-5, help="GRPO's optimizer.lr")
    p.add_argument("--temperature", type=float, default=0.5, help="rl.temperature")
    p.add_argument("--dump_folder", default="/tmp/torchtitan_bench_rl_calc", help="emptied first")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="after --: trainer flags for GRPO")
    args = p.parse_args()
    args.overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    return args


def main() -> int:
    args = parse_args()
    start = time.perf_counter()
    base = Path(args.dump_folder)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    hf_in, sft_report = (Path(args.sft_hf), {"sft_hf": args.sft_hf}) if args.sft_hf else sft(args, base)
    tokenizer = ChatTokenizer(str(ASSETS / "tokenizer"))
    val = val_prompts(base)
    before = held_out(hf_in, tokenizer, val)
    print(f"rl_calc: before GRPO {before['exact']} held out", file=sys.stderr, flush=True)
    seconds, records = grpo(args, hf_in, base / "grpo")
    after = held_out(base / "grpo" / "policy" / f"step-{args.steps}", tokenizer, val)
    report = {
        "benchmark": "rl_calc",
        **machine(),
        "settings": {k: v for k, v in vars(args).items() if k != "dump_folder"},
        "sft": sft_report,
        "before": before,
        "after": after,
        "grpo_s": round(seconds, 1),
        "reward_curve": [round(r["reward_mean"], 3) for r in records],
        "total_s": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
