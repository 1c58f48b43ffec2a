"""LoRA (and QLoRA) vs full fine-tuning on one process: step time (interleaved, so machine load cancels), trainable share.

Builds the model twice through the trainer's build path (``build.build_model``; LoRA as the ``[lora]`` transform),
then times forward + backward + AdamW steps on random tokens, alternating the two models each round, and
reports medians and the fastest step of each and their ratios (LoRA / full); ``--qlora`` adds a third model, LoRA
on an NF4 base (``lora.quantize_base = 'nf4'``, quantized as the trainer does after its load). Peak memory is the estimator's
business (``tests/runs/estimation/test_estimation.py`` measures both with torch's tracker on the real step). Prints one JSON
object.

    python -m bench.lora [--flavor debugmodel] [--rank 16] [--seq_len 256] [--batch_size 4] [--rounds 8] [--qlora]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from torchtitan.build import build_model, build_model_args
from torchtitan.components.optim.optimizer import build_optimizer
from torchtitan.config.manager import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.spec import get_model_spec


def _build(argv: list[str]):
    cfg = JobConfig.parse_args(argv, world_size=1)
    spec = get_model_spec(cfg.model.name)
    args = build_model_args(cfg, spec, 2048, device_type="cpu")
    dims = ParallelDims.from_sections(training=cfg.training, experimental=cfg.experimental, world_size=1)
    model = build_model(cfg, args, dims, None, torch.device("cpu"))
    return model, build_optimizer([model], cfg.optimizer)


def _step(model, optimizer, tokens: torch.Tensor) -> float:
    start = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--qlora", action="store_true", help="also time QLoRA (an NF4 base under the same adapters)")
    a = p.parse_args()
    torch.set_num_threads(1)
    base = ["--job.config_file", "./train_configs/debug_model.toml", "--model.flavor", a.flavor]
    base += ["--training.mixed_precision_param", "float32", "--training.seq_len", str(a.seq_len)]
    lora = ["--lora.enable", "--lora.rank", str(a.rank), "--lora.alpha", str(2 * a.rank)]
    runs = {"full": _build(base), "lora": _build([*base, *lora])}
    if a.qlora:
        from torchtitan.features.lora.quantize import quantize_base

        runs["qlora"] = _build([*base, *lora, "--lora.quantize_base", "nf4"])
        quantize_base([runs["qlora"][0]])
    tokens = torch.randint(0, 2048, (a.batch_size, a.seq_len + 1), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(2 + a.rounds):  # two warm-up rounds, dropped
        for name, (model, opt) in runs.items():
            times[name].append(_step(model, opt, tokens))
    times = {k: v[2:] for k, v in times.items()}
    model = runs["lora"][0]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    out = {k: {"median_s": statistics.median(v), "best_s": min(v)} for k, v in times.items()}
    out["ratio_median"] = out["lora"]["median_s"] / out["full"]["median_s"]
    out["ratio_best"] = out["lora"]["best_s"] / out["full"]["best_s"]
    if a.qlora:
        out["qlora_ratio_median"] = out["qlora"]["median_s"] / out["full"]["median_s"]
    out |= {"trainable_params": trainable, "params": total, "trainable_share": trainable / total}
    out |= {"flavor": a.flavor, "rank": a.rank, "tokens_per_step": a.batch_size * a.seq_len, "threads": 1}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
