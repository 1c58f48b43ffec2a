"""Ring async TP vs. sync sequence-parallel TP: forward+backward step time on CPU/gloo.

Spawns ``--world_size`` processes (one thread each), builds the same stack of attention-like +
SwiGLU blocks twice from one init (sync SP plan, and the async plan of
torchtitan.distributed.tensor_parallel.async_tp), and alternates timed blocks of steps between them after a
warmup so machine noise hits both alike. Rank 0 prints one JSON object; ratio = async / sync.

    python -m bench.async_tp [--dim 1024] [--ffn_dim 4096] [--seq_len 512] [--batch_size 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from bench.spawn import spawn_ranks
from torchtitan.distributed.tensor_parallel.plan import async_block_plan, block_plan


class Attention(nn.Module):
    """Attention-shaped: wq/wk/wv share one input, an elementwise mix, then wo. All matmul cost."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, rope: object = None) -> torch.Tensor:
        return self.wo(self.wq(x) * torch.sigmoid(self.wk(x)) + self.wv(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, ffn_dim, bias=False), nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(dim), Attention(dim)
        self.ffn_norm, self.feed_forward = nn.RMSNorm(dim), FeedForward(dim, ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), None)  # llama's (x, rope) signature
        return h + self.feed_forward(self.ffn_norm(h))


def sync_plan() -> dict:
    """The trainer's sync SP block plan (one all-gather per shared input, on the parent)."""
    return block_plan()


def async_plan() -> dict:
    """The trainer's async block plan: one AsyncColwiseParallel instance per shared input."""
    return async_block_plan()


def build_stack(args: argparse.Namespace, mesh: DeviceMesh, plan) -> nn.Sequential:
    torch.manual_seed(0)  # the same init for both variants and on every rank
    stack = nn.Sequential(*(Block(args.dim, args.ffn_dim) for _ in range(args.n_blocks)))
    for block in stack:
        parallelize_module(block, mesh, plan())
    return stack


def timed_steps(stack: nn.Module, x: torch.Tensor, n: int) -> list[float]:
    """Forward + backward step times in ms; the barrier keeps one rank's lag out of the next block."""
    times = []
    dist.barrier()
    for _ in range(n):
        start = time.perf_counter()
        stack(x).sum().backward()
        times.append((time.perf_counter() - start) * 1e3)
    stack.zero_grad(set_to_none=True)
    return times


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=600),
    )
    try:
        mesh = init_device_mesh("cpu", (args.world_size,), mesh_dim_names=("tp",))
        stacks = {"sync": build_stack(args, mesh, sync_plan), "async": build_stack(args, mesh, async_plan)}
        torch.manual_seed(1)
        local_seq = args.seq_len // args.world_size
        x = torch.randn(args.batch_size, local_seq, args.dim, requires_grad=True)  # this rank's shard
        for stack in stacks.values():
            timed_steps(stack, x, args.warmup)
        times: dict[str, list[float]] = {"sync": [], "async": []}
        for _ in range(args.rounds):
            for name, stack in stacks.items():
                times[name] += timed_steps(stack, x, args.steps_per_round)
        if rank == 0:
            print(json.dumps(report(args, times)), flush=True)
    finally:
        dist.destroy_process_group()


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> dict:
    sync_ms, async_ms = statistics.median(times["sync"]), statistics.median(times["async"])
    return {
        "sync_step_ms_median": round(sync_ms, 1),
        "async_step_ms_median": round(async_ms, 1),
        "ratio_async_over_sync": round(async_ms / sync_ms, 3),
        "sync_step_ms_all": [round(t, 1) for t in times["sync"]],
        "async_step_ms_all": [round(t, 1) for t in times["async"]],
        "settings": {**vars(args), "threads_per_rank": 1, "backend": "gloo", "dtype": "float32"},
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world_size", type=int, default=2, help="TP degree = number of processes")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn_dim", type=int, default=4096)
    p.add_argument("--seq_len", type=int, default=512, help="global sequence length (divisible by world_size)")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--n_blocks", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant")
    p.add_argument("--rounds", type=int, default=3, help="alternations of sync and async blocks")
    p.add_argument("--steps_per_round", type=int, default=2)
    args = p.parse_args()
    if args.seq_len % args.world_size:
        p.error(f"--seq_len ({args.seq_len}) must be divisible by --world_size ({args.world_size})")
    return args


def main() -> None:
    args = parse_args()
    spawn_ranks(worker, (args,), args.world_size)


if __name__ == "__main__":
    main()
