"""Command line of estimation.py: argument handling and exit codes only."""

from __future__ import annotations

import json
import os
import sys

from torchtitan.config.manager import JobConfig, format_help, wants_help
from torchtitan.estimation.estimate import estimate_memory
from torchtitan.estimation.plan import Hardware, format_plan, make_plan, plan_to_dict
from torchtitan.estimation.report import format_table, to_json

USAGE = """usage: estimation.py --job.config_file FILE [--world_size N] [--json] [--full_depth] [--section.key VALUE ...]
       estimation.py --plan --memory_gib M --job.config_file FILE [--world_size N] [--json]
                     [--gpu NAME] [--gpus_per_node G] [--top K] [--section.key VALUE ...]
       (or --module MOD --config F instead of --job.config_file FILE: the config that function F of MOD returns)

Estimates per-rank peak memory of one training step of the config (world size from --world_size,
else NGPU as in run_llama_train.sh, else 1) with the trainer's own build and step on fake tensors.
Deep models are estimated at two reduced depths and extrapolated (exact for identical blocks);
--full_depth runs every layer. --plan enumerates the layouts of the world size that fit M GiB per
rank (same global batch as the config) and ranks them with a simple throughput model for --gpu
(default H100) nodes of --gpus_per_node (default 8), estimating best-first until --top (default 10)
layouts fit. See docs/estimation.md."""


def _pop_option(argv: list[str], name: str, *, flag: bool = False) -> str | None:
    if name not in argv:
        return None
    i = argv.index(name)
    if flag:
        del argv[i]
        return "1"
    if i + 1 >= len(argv):
        raise ValueError(f"{name} needs a value")
    value = argv[i + 1]
    del argv[i : i + 2]
    return value


def _positive(name: str, value: str, kind: type = int):
    """``value`` as a positive ``kind`` (int or float), else a ValueError naming the option."""
    try:
        x = kind(value)
    except ValueError:
        x = 0
    if not x > 0:
        raise ValueError(f"{name} must be a positive {'integer' if kind is int else 'number'}, got {value!r}")
    return x


def _run(argv: list[str]) -> int:
    world = _pop_option(argv, "--world_size")
    as_json = _pop_option(argv, "--json", flag=True) is not None
    plan = _pop_option(argv, "--plan", flag=True) is not None
    full_depth = _pop_option(argv, "--full_depth", flag=True) is not None
    memory_gib = _pop_option(argv, "--memory_gib")
    gpu = _pop_option(argv, "--gpu")
    gpus_per_node = _pop_option(argv, "--gpus_per_node")
    top = _pop_option(argv, "--top")
    world_size = _positive("--world_size", world if world is not None else os.environ.get("NGPU", "1"))
    config = JobConfig.parse_args(argv, world_size=world_size)
    title = f"{config.model.name} {config.model.flavor}"
    if plan:
        if memory_gib is None:
            raise ValueError("--plan needs --memory_gib M (the memory of one device, GiB)")
        hw = Hardware(gpu=gpu or "H100", gpus_per_node=_positive("--gpus_per_node", gpus_per_node or "8"))
        hw.peak_flops  # noqa: B018 - validates --gpu before the long run
        top_k = _positive("--top", top or "10")
        result = make_plan(
            config,
            world_size,
            _positive("--memory_gib", memory_gib, float),
            hw,
            top=top_k,
            log=(lambda line: None) if as_json else (lambda line: print(line, file=sys.stderr)),
        )
        print(json.dumps(plan_to_dict(result), indent=2) if as_json else format_plan(result, title, top_k))
        return 0 if result.rows else 1
    for name, value in (
        ("--memory_gib", memory_gib),
        ("--gpu", gpu),
        ("--gpus_per_node", gpus_per_node),
        ("--top", top),
    ):
        if value is not None:
            raise ValueError(f"{name} only applies with --plan")
    est = estimate_memory(config, world_size, full_depth=full_depth)
    print(to_json(est) if as_json else format_table(est, title))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(USAGE + "\n\n" + format_help())
        return 0
    try:
        return _run(argv)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
