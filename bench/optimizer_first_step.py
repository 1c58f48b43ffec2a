"""The optimizer step over DTensor parameters: torch's AdamW (DTensor dispatch) against ours (local shards), side by side.

Each rank builds the model at the layout, takes one forward and backward, then, in turns for ``--reps`` rounds:
clears DTensor's sharding caches (a fresh process's state), times the first ``step`` of a fresh optimizer of each
kind, then ``--warm`` more steps (CPU seconds of this rank, ``time.process_time``). The two kinds' parameters are
checked bit-equal after the same number of steps. Prints one JSON object (rank 0).

    python -m bench.optimizer_first_step [--world 8] [--dp_replicate 2] [--dp_shard 2] [--tp 2] [--flavor debugmodel_tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench.spawn import spawn_ranks
from torchtitan.observability.peak_cache import cpu_model_name


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    os.environ.update(env, WORLD_SIZE=str(args.world))
    torch.set_num_threads(1)
    from torchtitan.distributed.backend.device import get_device_info, init_distributed

    init_distributed(get_device_info(rank), timeout_s=600)  # CUDA + NCCL where a GPU exists, else CPU + gloo
    from torchtitan.components.optim import local_shards
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.backend.dtensor import local_shard
    from torchtitan.distributed.parallel_dims import clear_dtensor_caches
    from torchtitan.train import Trainer

    argv = [
        *("--model.flavor", args.flavor, "--training.seq_len", "64", "--training.batch_size", "2"),
        *("--training.data_parallel_replicate_degree", str(args.dp_replicate)),
        *(
            "--training.data_parallel_shard_degree",
            str(args.dp_shard),
            "--training.tensor_parallel_degree",
            str(args.tp),
        ),
        *("--training.mixed_precision_param", "float32", "--metrics.log_freq", "1000", "--validation.enabled", "false"),
    ]
    trainer = Trainer(JobConfig.parse_args(argv, world_size=args.world), world_size=args.world, rank=rank)
    model = trainer.core.model_parts[0]
    batch = trainer.next_batches(iter(trainer.data_loader))[0]
    trainer.core.step_fn.forward_backward(batch, accum_steps=1, token_weight=None)
    params = [p for p in model.parameters() if p.grad is not None]
    start = {id(p): p.detach().clone() for p in params}
    settings = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "foreach": True}
    kinds = {"torch AdamW (DTensor dispatch)": torch.optim.AdamW, "ours (local shards)": local_shards.AdamW}
    first: dict[str, list[float]] = {k: [] for k in kinds}
    warm: dict[str, list[float]] = {k: [] for k in kinds}
    after: dict[str, list[torch.Tensor]] = {}
    for _ in range(args.reps):
        for name, cls in kinds.items():
            with torch.no_grad():
                for p in params:
                    p.copy_(start[id(p)])
            opt = cls(params, **settings)
            clear_dtensor_caches()
            dist.barrier()
            t = time.process_time()
            opt.step()
            first[name].append(time.process_time() - t)
            t = time.process_time()
            for _ in range(args.warm):
                opt.step()
            warm[name].append((time.process_time() - t) / max(args.warm, 1))
            after[name] = [p.detach().clone() for p in params]
    a, b = after.values()
    equal = all(torch.equal(local_shard(x), local_shard(y)) for x, y in zip(a, b, strict=True))
    if rank == 0:
        names = list(kinds)
        out = {
            "bench": "optimizer_first_step",
            "cpu": cpu_model_name(),
            "torch": torch.__version__,
            "world": args.world,
            "layout": {"dp_replicate": args.dp_replicate, "dp_shard": args.dp_shard, "tp": args.tp},
            "flavor": args.flavor,
            "parameters": len(params),
            "first_step_cpu_s": {k: round(statistics.median(v), 4) for k, v in first.items()},
            "warm_step_cpu_s": {k: round(statistics.median(v), 5) for k, v in warm.items()},
            "first_step_ratio": round(statistics.median(first[names[0]]) / statistics.median(first[names[1]]), 2),
            "warm_step_ratio": round(statistics.median(warm[names[0]]) / statistics.median(warm[names[1]]), 2),
            "bit_equal": equal,
        }
        print(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--dp_replicate", type=int, default=2)
    p.add_argument("--dp_shard", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--flavor", default="debugmodel_tiny")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warm", type=int, default=3)
    args = p.parse_args()
    if args.dp_replicate * args.dp_shard * args.tp != args.world:
        p.error(
            f"--dp_replicate x --dp_shard x --tp = {args.dp_replicate * args.dp_shard * args.tp}, not --world {args.world}"
        )
    spawn_ranks(_rank, (args,), args.world)


if __name__ == "__main__":
    main()
