"""Muon's optimizer-step time against AdamW's on the debug model: one process and FSDP2, side by side.

Each rank builds the model as the trainer does (``build_model``, fp32), sets random gradients, and times
``optimizer.step()`` for AdamW (optimizer.name = "AdamW") and Muon (optimizer.name = "Muon": Muon for the hidden
matrices, AdamW for the rest), taking turns, ``--reps`` times ``--steps`` steps each; the median step of each is
compared. Under FSDP2 both distributed strategies for the orthogonalisation are timed (their results are
checked bit-equal first):

* round-robin (what components/optim/muon.py runs on a one-axis mesh: muon_shipped): matrix i goes to rank i % world
  (a gather to it), which orthogonalises it and scatters the shards back (each matrix once in the world);
* gather (muon_gather; what FSDP x TP and HSDP run): every rank all-gathers each matrix's update and
  orthogonalises all of them (each matrix once per rank, redundantly).

Prints one JSON object (docs/performance.md has the figures).

    python -m bench.muon [--world 2] [--flavor debugmodel] [--steps 5] [--reps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from torchtitan.build import build_model
from torchtitan.components.optim.muon import MuonAdam
from torchtitan.components.optim.optimizer import build_optimizer
from torchtitan.config.manager import JobConfig
from torchtitan.distributed.backend.dtensor import local_shard
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.spec import get_model_spec


def _build(flavor: str, world: int, name: str):
    config = JobConfig.parse_args(
        ["--model.flavor", flavor, "--training.mixed_precision_param", "float32", "--optimizer.name", name],
        world_size=world,
    )
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world)
    args = dataclasses.replace(get_model_spec("llama3").flavors[flavor], vocab_size=2304)  # the shipped tokenizer's
    torch.manual_seed(0)
    model = build_model(config, args, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    return model, build_optimizer([model], config.optimizer)


def _set_grads(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=g) * 1e-2
        if isinstance(p, DTensor):
            rank, world = dist.get_rank(), dist.get_world_size()
            full = full.chunk(world, dim=0)[rank].contiguous()  # FSDP2's Shard(0)
            p.grad = DTensor.from_local(full, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        else:
            p.grad = full


class _GatherOnly(MuonAdam):
    round_robin = False


def _timed(fn, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        t = time.perf_counter()
        fn()
        if dist.is_initialized():
            dist.barrier()
        times.append(time.perf_counter() - t)
    return times


def _worker(rank: int, world: int, args: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(args.threads)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        adamw, adamw_opt = _build(args.flavor, world, "AdamW")
        muon, muon_opt = _build(args.flavor, world, "Muon")
        runs = {"adamw": (adamw, adamw_opt.step), "muon_shipped": (muon, muon_opt.step)}
        if world > 1:
            twin, twin_opt = _build(args.flavor, world, "Muon")
            twin_opt.__class__ = _GatherOnly  # the same optimizer, every matrix on the all-gather path
            _check_equal(muon, muon_opt, twin, twin_opt)
            runs["muon_gather"] = (twin, twin_opt.step)
        times = {k: [] for k in runs}
        for rep in range(args.reps):
            for name, (model, step) in runs.items():
                _set_grads(model, rep)
                times[name] += _timed(step, args.steps)
        if rank == 0:
            out.update({k: statistics.median(v) for k, v in times.items()})
    finally:
        if world > 1:
            dist.destroy_process_group()


def _check_equal(muon, muon_opt, twin, twin_opt) -> None:
    for model, opt in ((muon, muon_opt), (twin, twin_opt)):
        _set_grads(model, 99)
        opt.step()
    for (n, p), q in zip(muon.named_parameters(), twin.parameters()):
        assert torch.equal(local_shard(p), local_shard(q)), f"round-robin differs from gather at {n}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args()
    result = {"flavor": args.flavor, "threads_per_rank": args.threads, "cpu": _cpu()}
    for world in sorted({1, args.world}):
        with mp.Manager() as manager:
            out = manager.dict()
            if world == 1:
                _worker(0, 1, args, out)
            else:
                mp.spawn(_worker, args=(world, args, out), nprocs=world)
            t = dict(out)
        row = {f"{k}_step_ms": round(v * 1e3, 2) for k, v in t.items()}
        row["muon_over_adamw"] = round(t["muon_shipped"] / t["adamw"], 2)
        if "muon_gather" in t:
            row["muon_gather_over_adamw"] = round(t["muon_gather"] / t["adamw"], 2)
        result["1 process" if world == 1 else f"fsdp{world}"] = row
    print(json.dumps(result, indent=2))


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
