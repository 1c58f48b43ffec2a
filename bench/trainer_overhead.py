"""Trainer overhead: the trainer's step vs. a minimal hand-written PyTorch loop, in one process.

Both train the same model (same flavor, init, shapes, AdamW, clipping) on the same data. They
alternate in blocks so machine noise hits both alike; each block's tokens/s is measured after a
warmup, and the medians are compared. Prints one JSON object; ratio = trainer / minimal.

    python -m bench.trainer_overhead [--steps 5] [--reps 4] [--seq_len 128] [--batch_size 8]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from torchtitan.config.manager import JobConfig
from torchtitan.distributed.init import init_model_weights
from torchtitan.models import Transformer
from torchtitan.preflight import run_preflight
from torchtitan.train import Trainer


def build_trainer(args: argparse.Namespace) -> Trainer:
    config = JobConfig.parse_args(
        [
            "--job.config_file",
            "train_configs/debug_model.toml",
            "--job.dump_folder",
            "/tmp/torchtitan_bench_overhead",
            "--training.seq_len",
            str(args.seq_len),
            "--training.batch_size",
            str(args.batch_size),
            "--training.steps",
            "1000000",
            "--metrics.log_freq",
            str(args.steps),  # one log (one sync) per timed block, like a real run
            "--training.gc_freq",
            "1000",
        ]
    )
    run_preflight(config, world_size=1)
    return Trainer(config, world_size=1, rank=0)


class MinimalLoop:
    """What a user would write by hand: model, AdamW, clip, step. No config, metrics or data pipeline."""

    def __init__(self, trainer: Trainer, batches: list[tuple[torch.Tensor, torch.Tensor]]):
        with torch.device("meta"):
            self.model = Transformer(trainer.model_args)
        self.model.to_empty(device="cpu")
        init_model_weights(self.model, 0, torch.device("cpu"))
        opt = trainer.config.optimizer
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=opt.lr,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            foreach=True,
        )
        self.max_norm = trainer.config.training.max_norm
        self.batches = batches
        self.i = 0

    def step(self) -> torch.Tensor:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        loss = F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def timed_block(fn, steps: int, tokens_per_step: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return steps * tokens_per_step / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--reps", type=int, default=4, help="timed blocks per contender")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=8)
    args = parser.parse_args()
    logging.disable(logging.INFO)  # the trainer's step lines would interleave with the JSON

    trainer = build_trainer(args)
    trainer.data_iter = iter(trainer.data_loader)
    batches = [next(trainer.data_iter) for _ in range(args.steps)]  # (inputs, labels) each
    minimal = MinimalLoop(trainer, batches)
    tokens = args.seq_len * args.batch_size
    contenders = {"trainer": trainer.run_step, "minimal": minimal.step}
    for fn in contenders.values():  # warmup: allocator, first-touch, caches
        timed_block(fn, 2, tokens)
    results: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.reps):
        for name, fn in contenders.items():
            results[name].append(timed_block(fn, args.steps, tokens))
    trainer.close()
    median = {name: statistics.median(v) for name, v in results.items()}
    print(
        json.dumps(
            {
                "benchmark": "trainer_overhead",
                "tokens_per_step": tokens,
                "threads": torch.get_num_threads(),
                "trainer_tps": median["trainer"],
                "minimal_tps": median["minimal"],
                "ratio": median["trainer"] / median["minimal"],
                "trainer_tps_all": results["trainer"],
                "minimal_tps_all": results["minimal"],
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
