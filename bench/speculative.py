"""Speculative decoding with a DeepSeek-V3 checkpoint's MTP depths against plain greedy decoding: acceptance, tokens/s.

Loads the checkpoint as ``scripts/generate.py`` does (its run's tokenizer), then for each prompt runs plain cached
greedy decoding and ``--speculative mtp``'s decoding in turns, ``--reps`` rounds, each ``--max_new_tokens`` tokens (no
stop at eos, so both generate as many); checks the tokens equal; prints one JSON object: the acceptance (accepted /
drafted over the prompts), each decoder's tokens/s (the median round, all prompts' tokens over their time) and the
speedup, with the CPU, torch and its thread count.

    python -m bench.speculative CKPT [--prompt "def main(" --prompt ...] [--max_new_tokens 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from torchtitan.components.generation import generate
from torchtitan.components.generation.speculative import generate_speculative
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.observability.peak_cache import cpu_model_name

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ("def main(", "import os\n", "class Config:\n    ", "The function returns")


def generate_script():
    """scripts/generate.py as a module (scripts/ is not a package): its checkpoint loading and default tokenizer."""
    spec = importlib.util.spec_from_file_location("generate_script", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_round(model: torch.nn.Module, prompts: list[torch.Tensor], max_new: int) -> dict[str, float]:
    """Both decoders over every prompt: their seconds, and the speculative one's drafted and accepted tokens.

    Raises:
        AssertionError: the speculative tokens differ from plain decoding's.
    """
    out = {"plain_s": 0.0, "speculative_s": 0.0, "drafted": 0, "accepted": 0}
    for ids in prompts:
        began = time.perf_counter()
        plain = generate(model, ids, max_new)
        out["plain_s"] += time.perf_counter() - began
        tokens, stats = generate_speculative(model, ids, max_new)
        out["speculative_s"] += stats.seconds
        out["drafted"] += stats.drafted
        out["accepted"] += stats.accepted
        assert torch.equal(tokens, plain), "speculative decoding's tokens differ from plain greedy decoding's"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a complete checkpoint folder (step-N) of a deepseek_v3 run with mtp_layers")
    p.add_argument("--prompt", action="append", help=f"repeatable; default: {list(PROMPTS)}")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    script = generate_script()
    tokenizer = build_tokenizer(script.default_tokenizer(None, args.checkpoint))
    prompts = [torch.tensor([tokenizer.encode_prompt(text)]) for text in args.prompt or PROMPTS]
    max_len = max(ids.shape[1] for ids in prompts) + args.max_new_tokens
    model = script.load_model(args.checkpoint, None, max_len, tokenizer.n_words, torch.device("cpu"))
    one_round(model, prompts[:1], 4)  # warm-up
    rounds = [one_round(model, prompts, args.max_new_tokens) for _ in range(args.reps)]
    n_tokens = len(prompts) * args.max_new_tokens
    plain = statistics.median(n_tokens / r["plain_s"] for r in rounds)
    speculative = statistics.median(n_tokens / r["speculative_s"] for r in rounds)
    result = {
        "checkpoint": args.checkpoint,
        "mtp_layers": model.args.mtp_layers,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "tokens_equal": True,
        "drafted": rounds[0]["drafted"],
        "accepted": rounds[0]["accepted"],
        "acceptance": round(rounds[0]["accepted"] / max(rounds[0]["drafted"], 1), 3),
        "plain_tokens_per_s": round(plain, 1),
        "speculative_tokens_per_s": round(speculative, 1),
        "speedup": round(speculative / plain, 3),
        "cpu": cpu_model_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
