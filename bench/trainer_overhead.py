"""Trainer overhead: the trainer's step vs. a minimal hand-written PyTorch loop, in one process.

Both train the same model (same flavor, init, shapes, AdamW, clipping) on the same data. They
alternate in blocks so machine noise hits both alike; each block's tokens/s is measured after a
warmup, and the medians are compared. Prints one JSON object; ratio = trainer / minimal.

``--upstream DIR`` adds a third contender: torchtitan Dec-2024's own Transformer (its model and norms files,
read from the tree ``../shared/perf/README.md`` exports to DIR) holding our model's weights, in that loop as
its train.py runs it. Side by side in one process, the machine's drift between runs (what ``compare.sh``'s
separate processes see) hits all three alike; ``upstream_ratio`` = trainer / torchtitan-2024.

``--pairs N`` (with ``--upstream``) adds forward+backward alone of our model and torchtitan-2024's, same weights and
batch, N pairs in ABBA order: ``forward_backward.torchtitan_2024_over_ours_seconds_paired_median`` > 1 means ours
is faster.

    python -m bench.trainer_overhead [--steps 5] [--reps 4] [--seq_len 128] [--batch_size 8] [--upstream DIR] [--pairs N]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan.config.manager import JobConfig
from torchtitan.distributed.init import init_model_weights
from torchtitan.models import Transformer
from torchtitan.preflight import run_preflight
from torchtitan.train import Trainer


def build_trainer(args: argparse.Namespace) -> Trainer:
    extra = []
    if args.upstream is not None:  # compare.sh's settings: what torchtitan-2024 runs there
        extra = ["--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "none"]
    config = JobConfig.parse_args(
        [
            *extra,
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


def _load_source(name: str, path: Path, imports: dict[str, str]):
    """A module from a foreign tree's file under its own name, its imports of that tree's package swapped for the
    given lines (each must be in the file: a tree of another commit fails here, not later)."""
    source = path.read_text()
    for old, new in imports.items():
        if old not in source:
            raise SystemExit(
                f"error: --upstream: {path} has no line {old!r}: not the tree ../shared/perf/README.md exports"
            )
        source = source.replace(old, new)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None, origin=str(path)))
    sys.modules[name] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def upstream_model(root: Path, trainer: Trainer, seq_len: int) -> torch.nn.Module:
    """torchtitan-2024's Transformer at our model's shapes, holding our model's initial weights."""
    _load_source(
        "tt2024_norms", root / "torchtitan/models/norms.py", {"from torchtitan.utils import device_module": ""}
    )
    model_py = _load_source(
        "tt2024_model",
        root / "torchtitan/models/llama/model.py",
        {"from torchtitan.models.norms import build_norm": "from tt2024_norms import build_norm"},
    )
    ours = trainer.model_args
    fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier")
    shape = {name: getattr(ours, name) for name in (*fields, "norm_eps", "rope_theta")}  # the same names in both
    args = model_py.ModelArgs(**shape, max_seq_len=seq_len)
    with torch.device("meta"):
        model = model_py.Transformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()  # its RoPE table; the weights are ours, below
    state = trainer.model_parts[0].state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) != {"freqs_cis"}:  # the buffer it computes itself
        raise SystemExit(f"error: --upstream: weights do not map: missing {missing}, unexpected {unexpected}")
    return model


class MinimalLoop:
    """What a user would write by hand: model, AdamW, clip, step. No config, metrics or data pipeline.

    ``model``: another model to train that way (torchtitan-2024's); default ours, freshly initialised."""

    def __init__(self, trainer: Trainer, batches: list[tuple[torch.Tensor, torch.Tensor]], model=None):
        if model is None:
            with torch.device("meta"):
                model = Transformer(trainer.model_args)
            model.to_empty(device="cpu")
            init_model_weights(model, 0, torch.device("cpu"))
        self.model = model
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


def forward_backward_pairs(models: dict, batch: tuple[torch.Tensor, torch.Tensor], pairs: int) -> dict:
    """Forward, loss and backward (no optimizer) of two models on one batch, one at a time in ABBA order; each pair's
    seconds ratio: the step's model part alone, without the noise of a block of several steps."""
    (name_a, a), (name_b, b) = models.items()
    x, y = batch

    def once(model) -> float:
        start = time.perf_counter()
        F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(0, 1)).backward()
        seconds = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return seconds

    for _ in range(2):  # warmup
        once(a), once(b)
    times: dict[str, list[float]] = {name_a: [], name_b: []}
    for i in range(pairs):
        order = ((name_a, a), (name_b, b)) if i % 2 == 0 else ((name_b, b), (name_a, a))
        for name, model in order:
            times[name].append(once(model))
    ratios = [tb / ta for ta, tb in zip(times[name_a], times[name_b])]
    return {
        "pairs": pairs,
        **{f"{name}_ms_median": 1e3 * statistics.median(v) for name, v in times.items()},
        f"{name_b}_over_{name_a}_seconds_paired_median": statistics.median(ratios),
        f"{name_b}_over_{name_a}_seconds_total": sum(times[name_b]) / sum(times[name_a]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--reps", type=int, default=4, help="timed blocks per contender")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument(
        "--upstream",
        type=Path,
        default=None,
        help="torchtitan at 3f20451bc exported as ../shared/perf/README.md says (e.g. /tmp/perf/tt2024): "
        "its Transformer joins as a third contender, at compare.sh's settings (fp32, no AC)",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="with --upstream: also time forward+backward alone of our model and torchtitan-2024's (same weights, "
        "same batch), this many pairs in ABBA order",
    )
    args = parser.parse_args()
    if args.upstream is not None and not (args.upstream / "torchtitan/models/llama/model.py").is_file():
        parser.error(
            f"--upstream {args.upstream}: no torchtitan/models/llama/model.py there; export it as "
            "../shared/perf/README.md says (e.g. to /tmp/perf/tt2024)"
        )
    logging.disable(logging.INFO)  # the trainer's step lines would interleave with the JSON

    trainer = build_trainer(args)
    trainer.data_iter = iter(trainer.data_loader)
    batches = [next(trainer.data_iter) for _ in range(args.steps)]  # (inputs, labels) each
    minimal = MinimalLoop(trainer, batches)
    tokens = args.seq_len * args.batch_size
    contenders = {"trainer": trainer.run_step, "minimal": minimal.step}
    upstream = None
    if args.upstream is not None:
        upstream = upstream_model(args.upstream, trainer, args.seq_len)
        contenders["torchtitan_2024"] = MinimalLoop(trainer, batches, upstream).step
    for fn in contenders.values():  # warmup: allocator, first-touch, caches
        timed_block(fn, 2, tokens)
    results: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for rep in range(args.reps):  # the order rotates, so none always runs right after another
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            results[name].append(timed_block(contenders[name], args.steps, tokens))
    pairs = None
    if upstream is not None and args.pairs > 0:
        models = {"ours": trainer.model_parts[0], "torchtitan_2024": upstream}
        pairs = forward_backward_pairs(models, batches[0], args.pairs)
    trainer.close()
    median = {name: statistics.median(v) for name, v in results.items()}
    report = {
        "benchmark": "trainer_overhead",
        "tokens_per_step": tokens,
        "threads": torch.get_num_threads(),
        **{f"{name}_tps": median[name] for name in names},
        "ratio": median["trainer"] / median["minimal"],
        **{f"{name}_tps_all": results[name] for name in names},
    }
    if args.upstream is not None:
        report["upstream_ratio"] = median["trainer"] / median["torchtitan_2024"]
    if pairs is not None:
        report["forward_backward"] = pairs
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
