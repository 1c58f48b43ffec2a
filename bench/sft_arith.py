"""Fine-tuning an HF model on the shipped chat task, end to end: exact match on held-out questions.

The user's path, in four steps, each through the real entry point:

1. **An HF model**: a random-init ``LlamaForCausalLM`` built by transformers at the shapes of
   ``--flavor`` (the run's ``model.flavor`` must describe the folder's shapes: the trainer compares the
   args it derives from config.json with the flavor's before reading a weight, so the folder is built
   from the flavor, as tests/runs/checkpoint/test_hf_finetune.py builds its own), with the shipped tokenizer's
   vocabulary (debugmodel_tiny: dim 64, 4 layers, 4 heads, FFN 256, an untied head; 306k parameters),
   saved by ``save_pretrained`` (safetensors) together with the tokenizer's files.
2. **Fine-tune**: ``python -m torchtitan.train`` (one process) on train_configs/sft_debug.toml
   (chat rows of "What is A plus B?", loss on the assistant turns) with ``checkpoint.initial_load_in_hf``
   from that folder, its tokenizer as ``model.tokenizer_path``, and ``checkpoint.last_save_in_hf``,
   which exports ``<dump_folder>/hf/step-N``.
3. **Answer**: each held-out conversation's first question (tests/assets/sft/arith_val.jsonl: pairs no
   training row asks, with its system message when it has one) and the first question of the first
   ``--train_questions`` training rows, rendered with the chat template (``prompting.chat_prompt_ids``),
   greedy-generated from the exported folder as loaded by ``scripts/generate.py --hf`` (in process), cut
   at the first chat stop id. Exact match: the answer equals the expected assistant text; number match:
   the answer's last integer is the sum.
4. **The CLI**: ``scripts/generate.py --hf OUT --tokenizer IN --chat --prompt "What is 7 plus 5?"`` once,
   as a subprocess; its printed answer is in the JSON.

Prints one JSON object (train time = the trainer subprocess's wall time, start-up included).

    python -m bench.sft_arith [--steps 3000] [--seed 0] [--flavor debugmodel_tiny] [--lr 1e-3]
        [--batch_size 8] [--dump_folder /tmp/torchtitan_bench_sft_arith] [-- trainer flags]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from torchtitan.components.generation import generate
from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.datasets.sft.prompting import chat_prompt_ids, chat_stop_ids, decode_answer

REPO = Path(__file__).resolve().parent.parent

ASSETS = REPO / "tests" / "assets" / "sft"
CONFIG = "train_configs/sft_debug.toml"
CLI_QUESTION = "What is 7 plus 5?"
MAX_NEW_TOKENS = 16  # the longest answer, "19 plus 19 is 38.", is 12 tokens with its end of turn


def generate_script():
    """scripts/generate.py as a module (scripts/ is not a package): its model loading for ``--hf``."""
    spec = importlib.util.spec_from_file_location("generate_script", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_hf_start(folder: Path, flavor: str, seed: int) -> dict:
    """A random-init LlamaForCausalLM of ``flavor``'s shapes and the shipped tokenizer, saved as the
    user's HF folder (``save_pretrained``: config.json, model.safetensors, tokenizer files); its config."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from torchtitan.build import build_meta_model
    from torchtitan.spec import get_model_spec

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors[flavor], vocab_size=len(tokenizer))
    meta = build_meta_model(spec, args).state_dict()  # for the FFN width the flavor's rounding gives
    config = spec.state_dict_adapter.hf_config(dataclasses.asdict(args), meta, dtype=torch.float32)
    torch.manual_seed(seed)
    special = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}, **special))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return config


def train_flags(args: argparse.Namespace, hf_in: Path, dump_folder: Path) -> list[str]:
    """The trainer's flags: sft_debug.toml from the HF folder, exported back at the last step."""
    return [
        *("--job.config_file", CONFIG, "--job.dump_folder", str(dump_folder)),
        *("--model.flavor", args.flavor, "--model.tokenizer_path", str(hf_in)),
        *("--training.steps", str(args.steps), "--training.seed", str(args.seed)),
        *("--training.batch_size", str(args.batch_size), "--training.warmup_steps", str(args.warmup)),
        *("--optimizer.lr", str(args.lr), "--metrics.log_freq", str(max(args.steps // 10, 1))),
        *("--validation.freq", str(args.steps), "--validation.steps", "3"),  # 12 of the 14 held-out windows
        *("--checkpoint.enable_checkpoint", "--checkpoint.interval", str(args.steps)),
        *("--checkpoint.initial_load_path", str(hf_in), "--checkpoint.initial_load_in_hf"),
        "--checkpoint.last_save_in_hf",
        *args.overrides,
    ]


def fine_tune(args: argparse.Namespace, hf_in: Path, dump_folder: Path) -> float:
    """Run the trainer (log in bench.log); its wall time in seconds."""
    cmd = [sys.executable, "-m", "torchtitan.train", *train_flags(args, hf_in, dump_folder)]
    log = dump_folder.parent / "bench.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        sys.exit(f"fine-tuning failed (exit {rc}): {' '.join(cmd)}\n--- last lines of {log} ---\n{tail}")
    return seconds


def first_questions(path: Path, limit: int | None = None) -> list[tuple[str | None, str, str]]:
    """(system message or None, first user question, its assistant answer) of each conversation."""
    out = []
    for line in path.read_text().splitlines()[:limit]:
        messages = json.loads(line)["messages"]
        system = next((m["content"] for m in messages if m["role"] == "system"), None)
        user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        out.append((system, messages[user]["content"], messages[user + 1]["content"]))
    return out


def last_integer(text: str) -> int | None:
    numbers = re.findall(r"\d+", text)
    return int(numbers[-1]) if numbers else None


def score(model: torch.nn.Module, tokenizer: ChatTokenizer, questions: list) -> dict:
    """Greedy answers to ``questions``: exact and number-only matches, and a few misses to read."""
    stop_ids = chat_stop_ids(tokenizer)
    exact = number = 0
    misses = []
    for system, user, expected in questions:
        ids = chat_prompt_ids(tokenizer, user, system=system)
        out = generate(model, torch.tensor([ids]), MAX_NEW_TOKENS, stop_token=stop_ids)
        answer = decode_answer(tokenizer, out[0, len(ids) :].tolist(), stop_ids)
        exact += answer == expected
        number += last_integer(answer) == last_integer(expected)
        if answer != expected and len(misses) < 3:
            misses.append({"question": user, "expected": expected, "answer": answer})
    n = len(questions)
    return {
        "exact": f"{exact}/{n}",
        "exact_rate": round(exact / n, 3),
        "number_rate": round(number / n, 3),
        "misses": misses,
    }


def cli_answer(hf_out: Path, hf_in: Path) -> dict:
    """``scripts/generate.py --hf OUT --chat`` as a user runs it: its exit code and printed answer."""
    cmd = [sys.executable, "scripts/generate.py", "--hf", str(hf_out), "--tokenizer", str(hf_in), "--chat"]
    cmd += ["--prompt", CLI_QUESTION]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    return {
        "prompt": CLI_QUESTION,
        "returncode": run.returncode,
        "answer": run.stdout.rstrip("\n"),
        "stderr_tail": run.stderr[-500:] if run.returncode else "",
    }


def losses(dump_folder: Path) -> dict:
    records = [json.loads(line) for line in (dump_folder / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "validation_loss" in r]
    return {
        "first_train_loss": train[0]["loss"],
        "final_train_loss": train[-1]["loss"],
        "final_validation_loss": val[-1]["validation_loss"] if val else None,
    }


def machine() -> dict:
    cpu = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")][:1]
    return {
        "device": f"cpu ({cpu[0] if cpu else 'unknown'})",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000, help="fine-tuning steps")
    p.add_argument("--seed", type=int, default=0, help="the HF model's init and the trainer's training.seed")
    p.add_argument("--flavor", default="debugmodel_tiny", help="llama3 flavor whose shapes the HF model has")
    p.add_argument("--lr", type=float, default=1e-3, help="optimizer.lr (linear warmup, then linear decay to 0)")
    p.add_argument("--warmup", type=int, default=50, help="training.warmup_steps")
    p.add_argument("--batch_size", type=int, default=8, help="128-token windows per step (3-4 examples each)")
    p.add_argument("--train_questions", type=int, default=40, help="training rows asked, for contrast")
    p.add_argument("--dump_folder", default="/tmp/torchtitan_bench_sft_arith", help="emptied first")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="after --: trainer flags")
    args = p.parse_args()
    args.overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    if min(args.steps, args.batch_size, args.train_questions) < 1 or args.warmup < 0:
        p.error("--steps, --batch_size and --train_questions must be >= 1, --warmup >= 0")
    return args


def main() -> int:
    args = parse_args()
    start = time.perf_counter()
    base = Path(args.dump_folder)
    shutil.rmtree(base, ignore_errors=True)
    hf_in, run = base / "hf_in", base / "run"
    run.mkdir(parents=True)
    hf_config = save_hf_start(hf_in, args.flavor, args.seed)
    train_s = fine_tune(args, hf_in, run)
    hf_out = run / "hf" / f"step-{args.steps}"
    tokenizer = ChatTokenizer(str(hf_in))
    held_out = first_questions(ASSETS / "arith_val.jsonl")
    seen = first_questions(ASSETS / "arith_train.jsonl", args.train_questions)
    longest = max(len(chat_prompt_ids(tokenizer, u, system=s)) for s, u, _ in held_out + seen)
    model = generate_script().load_model(
        None, str(hf_out), longest + MAX_NEW_TOKENS, tokenizer.base.n_words, torch.device("cpu")
    )
    answer_start = time.perf_counter()
    held_out_score, train_score = score(model, tokenizer, held_out), score(model, tokenizer, seen)
    answer_s = time.perf_counter() - answer_start
    cli = cli_answer(hf_out, hf_in)
    shape = {
        k: hf_config[k]
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    }
    report = {
        "benchmark": "sft_arith",
        **machine(),
        "flavor": args.flavor,
        "shape": shape,
        "parameters": sum(p.numel() for p in model.parameters()),
        "settings": {k: v for k, v in vars(args).items() if k != "dump_folder"},
        "train_s": round(train_s, 1),
        **losses(run),
        "held_out": held_out_score,
        "train_questions": train_score,
        "answer_s": round(answer_s, 1),
        "cli": cli,
        "total_s": round(time.perf_counter() - start, 1),
        "hf_out": str(hf_out),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
