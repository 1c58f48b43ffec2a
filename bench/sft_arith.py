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

Prints one JSON object on stdout (train time = the trainer subprocess's wall time, start-up included); the
trainer's output goes to stderr as it runs (a step line every steps/10 steps, at most every 50) and to
``<dump_folder>/bench.log``, which the first line names.

Ctrl-C (or SIGTERM) stops the trainer at the step in flight with a checkpoint; the same command resumes from it:
a dump folder that holds a complete checkpoint written with the same trainer flags is kept (and the HF start in it
reused), one with a checkpoint of other flags is refused in one line, anything else is emptied first. The trainer
also saves every steps/10 steps, so a killed run resumes from the last of those.

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
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from torchtitan.checkpointing.files.folders import FULL, SEED, list_checkpoints
from torchtitan.components.generation import generate
from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.datasets.sft.prompting import chat_prompt_ids, chat_stop_ids, decode_answer
from torchtitan.observability.logging import quiet_torchao_import

REPO = Path(__file__).resolve().parent.parent

ASSETS = REPO / "tests" / "assets" / "sft"
CONFIG = "train_configs/sft_debug.toml"
CLI_QUESTION = "What is 7 plus 5?"
MAX_NEW_TOKENS = 16  # the longest answer, "19 plus 19 is 38.", is 12 tokens with its end of turn
FLAGS_FILE = "bench_flags.json"  # in the dump folder: the trainer flags its run was started with
EXIT_STOPPED = 3  # the trainer's exit code after a stop signal, its checkpoint saved


def generate_script():
    """scripts/generate.py as a module (scripts/ is not a package): its model loading for ``--hf``."""
    spec = importlib.util.spec_from_file_location("generate_script", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_hf_start(folder: Path, flavor: str, seed: int) -> None:
    """A random-init LlamaForCausalLM of ``flavor``'s shapes and the shipped tokenizer, saved as the
    user's HF folder (``save_pretrained``: config.json, model.safetensors, tokenizer files)."""
    from transformers import AutoTokenizer, LlamaConfig

    with quiet_torchao_import():  # transformers' model classes import torchao, whose import notes say nothing here
        from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" of one small file: the trainer's lines follow

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


def train_flags(args: argparse.Namespace, hf_in: Path, dump_folder: Path) -> list[str]:
    """The trainer's flags: sft_debug.toml from the HF folder, exported back at the last step."""
    return [
        *("--job.config_file", CONFIG, "--job.dump_folder", str(dump_folder)),
        *("--model.flavor", args.flavor, "--model.tokenizer_path", str(hf_in)),
        *("--training.steps", str(args.steps), "--training.seed", str(args.seed)),
        *("--training.batch_size", str(args.batch_size), "--training.warmup_steps", str(args.warmup)),
        *("--optimizer.lr", str(args.lr), "--metrics.log_freq", str(min(max(args.steps // 10, 1), 50))),
        *("--validation.freq", str(args.steps), "--validation.steps", "3"),  # 12 of the 14 held-out windows
        *("--checkpoint.enable_checkpoint", "--checkpoint.interval", str(max(args.steps // 10, 1))),
        *("--checkpoint.keep_latest_k", "1"),
        *("--checkpoint.initial_load_path", str(hf_in), "--checkpoint.initial_load_in_hf"),
        "--checkpoint.last_save_in_hf",
        *args.overrides,
    ]


def prepare_folder(base: Path, flags: list[str]) -> int | None:
    """``base`` ready for the run: the step its checkpoint resumes from when it holds a complete one written with
    the same trainer ``flags`` (kept as it is), else None after emptying it; exits 2 (one line) when its
    checkpoint was written with other flags."""
    run = base / "run"
    saved = [c.step for c in list_checkpoints(str(run / "checkpoint")) if c.complete and c.kind in (FULL, SEED)]
    if saved:
        try:
            recorded = json.loads((base / FLAGS_FILE).read_text())
        except (OSError, ValueError):
            recorded = None
        if recorded == flags:
            return saved[-1]
        print(
            f"error: {base} holds a checkpoint (step-{saved[-1]}) of another bench run "
            f"({_flag_change(recorded, flags)}); run the command that wrote it to resume, or choose another "
            "--dump_folder (or delete the folder) to start over",
            file=sys.stderr,
        )
        sys.exit(2)
    shutil.rmtree(base, ignore_errors=True)
    run.mkdir(parents=True)
    (base / FLAGS_FILE).write_text(json.dumps(flags) + "\n")
    return None


def _flag_change(recorded: list[str] | None, flags: list[str]) -> str:
    """The first trainer flag whose value differs, as 'flag: then -> now'."""
    if not isinstance(recorded, list):
        return f"no readable {FLAGS_FILE}"

    def pairs(argv: list[str]) -> dict[str, str]:
        out, key = {}, None
        for arg in argv:
            if arg.startswith("--"):
                key = arg
                out[key] = "(set)"
            elif key is not None:
                out[key] = arg
        return out

    then, now = pairs(recorded), pairs(flags)
    key = next((k for k in [*now, *then] if then.get(k) != now.get(k)), None)
    return "the same flags in another order" if key is None else f"{key}: {then.get(key)} -> {now.get(key)}"


def fine_tune(args: argparse.Namespace, hf_in: Path, dump_folder: Path, log: Path) -> float:
    """Run the trainer, its output shown on stderr and appended to ``log``; its wall time in seconds.

    A SIGINT/SIGTERM to this process (Ctrl-C reaches the trainer too) is passed on to the trainer, which saves the
    step in flight and stops; this process then exits with its code, saying how to resume.
    """
    cmd = [sys.executable, "-m", "torchtitan.train", *train_flags(args, hf_in, dump_folder)]
    start = time.perf_counter()
    with (
        open(log, "a") as f,
        subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc,
    ):
        previous = {sig: signal.signal(sig, lambda signum, _: proc.send_signal(signum)) for sig in _STOP}
        try:
            for line in proc.stdout:
                f.write(line)
                sys.stderr.write(line)
            rc = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    seconds = time.perf_counter() - start
    if rc == EXIT_STOPPED:
        print(
            f"bench.sft_arith: the trainer stopped at a checkpoint in {dump_folder}; run the same command to resume",
            file=sys.stderr,
        )
        sys.exit(EXIT_STOPPED)
    if rc != 0:
        sys.exit(f"fine-tuning failed (exit {rc}): {' '.join(cmd)}\n(its output above, and in {log})")
    return seconds


_STOP = (signal.SIGINT, signal.SIGTERM)


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
    p.add_argument(
        "--dump_folder",
        default="/tmp/torchtitan_bench_sft_arith",
        help="emptied first, unless it holds a checkpoint: of the same trainer flags, the run resumes from it; "
        "of others, refused",
    )
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="after --: trainer flags")
    args = p.parse_args()
    args.overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    if min(args.steps, args.batch_size, args.train_questions) < 1 or args.warmup < 0:
        p.error("--steps, --batch_size and --train_questions must be >= 1, --warmup >= 0")
    return args


def main() -> int:
    args = parse_args()
    start = time.perf_counter()
    base = Path(args.dump_folder).resolve()
    hf_in, run, log = base / "hf_in", base / "run", base / "bench.log"
    resumed_from = prepare_folder(base, train_flags(args, hf_in, run))
    start_line = f"from a new HF start ({hf_in})" if resumed_from is None else f"resuming after step {resumed_from}"
    print(
        f"bench.sft_arith: fine-tuning {args.steps} steps {start_line} in {run}; the trainer's output follows "
        f"(also in {log}); Ctrl-C stops it at a checkpoint, the same command resumes",
        file=sys.stderr,
        flush=True,
    )
    if resumed_from is None:
        save_hf_start(hf_in, args.flavor, args.seed)
    hf_config = json.loads((hf_in / "config.json").read_text())
    train_s = fine_tune(args, hf_in, run, log)
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
        "resumed_from": resumed_from,
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
