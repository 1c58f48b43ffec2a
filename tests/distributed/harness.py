"""Run a function on N CPU processes joined by a gloo process group, and collect what each returns.

Spawned processes (not threads): each rank has its own RNG and its own torch state, exactly like
torchrun. Every rank uses one thread, the group is always destroyed, and the whole run has a
deadline so a collective mismatch fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        try:
            queue.put((rank, "ok", fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_distributed(fn: Callable, world_size: int, *args, timeout_s: float = 300) -> list:
    """fn(rank, world_size, *args) on each rank (fn must be importable); returns results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = _get(queue, procs, timeout_s)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed run failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def _get(queue, procs, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not queue.empty():
            return queue.get()
        if any(p.exitcode not in (None, 0) for p in procs):
            time.sleep(0.5)  # a crashed rank may still have queued its traceback
            if not queue.empty():
                return queue.get()
            raise RuntimeError(f"a rank died: exit codes {[p.exitcode for p in procs]}")
        time.sleep(0.05)
    raise TimeoutError(f"distributed run exceeded {timeout_s}s (a rank is probably stuck in a collective)")
