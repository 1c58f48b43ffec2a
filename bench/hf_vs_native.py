"""``model.name = "hf"`` (transformers' LlamaForCausalLM) vs our native llama3 on the same shapes, through the trainer.

Both run the same trainer, data, optimizer and layout: the native ``llama3`` flavor, and ``hf`` with a Llama
config.json of the same dims (hidden size, FFN width, heads, KV heads, RoPE theta, norm eps, vocabulary), in
alternating rounds so machine noise hits both alike. Each run's tokens/s is the median over its steps after
``--warmup``; peak memory is the run's logged peak (``memory`` in metrics.jsonl). Prints one JSON object with
the ratios hf / native.

    python -m bench.hf_vs_native [--flavor debugmodel] [--steps 20] [--rounds 2] [--ngpu 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from torchtitan.build import build_meta_model
from torchtitan.spec import get_model_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = "./torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken"


def llama_config(flavor: str) -> dict:
    """transformers' Llama config.json fields for our llama3 flavor's shapes."""
    spec = get_model_spec("llama3")
    args = spec.flavors[flavor]
    model = build_meta_model(spec, args)
    ffn = model.layers["0"].feed_forward.w1.weight.shape[0]
    if args.rope_scaling is not None:
        raise SystemExit(f"llama3 {flavor} scales its RoPE; pick a flavor without (debugmodel)")
    return {
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": ffn,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.head_dim,
        "rope_theta": args.rope_theta,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def run(model_args: list[str], opts, folder: str) -> dict:
    argv = [
        *("--job.config_file", "./train_configs/debug_model.toml", "--model.tokenizer_path", TOKENIZER),
        *("--training.steps", str(opts.steps), "--training.seq_len", str(opts.seq_len), "--metrics.log_freq", "1"),
        *("--training.batch_size", str(opts.batch_size), "--job.dump_folder", folder),
        *model_args,
    ]
    if opts.ngpu > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={opts.ngpu}", "-m", "torchtitan.train"]
    else:
        cmd = [sys.executable, "-m", "torchtitan.train"]
    subprocess.run([*cmd, *argv], cwd=ROOT, check=True, capture_output=True)
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if '"tps"' in line]
    steps = [r for r in records if r["step"] > opts.warmup]
    return {
        "tps": statistics.median(r["tps"] for r in steps),
        "peak_gib": max(r.get("memory_gib", r.get("memory", 0.0)) for r in steps),
        "final_loss": records[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ngpu", type=int, default=1)
    opts = parser.parse_args()
    config = json.dumps(llama_config(opts.flavor))
    variants = {
        "native": ["--model.name", "llama3", "--model.flavor", opts.flavor],
        "hf": ["--model.name", "hf", "--model.flavor", "config", "--model.hf_config", config],
    }
    results: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as base:
        for r in range(opts.rounds):
            for name, model_args in variants.items():
                results[name].append(run(model_args, opts, os.path.join(base, f"{name}{r}")))
    tps = {name: statistics.median(x["tps"] for x in runs) for name, runs in results.items()}
    peak = {name: max(x["peak_gib"] for x in runs) for name, runs in results.items()}
    print(
        json.dumps(
            {
                "flavor": opts.flavor,
                "ngpu": opts.ngpu,
                "seq_len": opts.seq_len,
                "batch_size": opts.batch_size,
                "torch": torch.__version__,
                "tps": tps,
                "peak_gib": peak,
                "tps_ratio_hf_over_native": tps["hf"] / tps["native"],
                "peak_ratio_hf_over_native": peak["hf"] / peak["native"] if peak["native"] else None,
                "runs": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
