"""Ranks on this machine for a benchmark: ``torch.multiprocessing.spawn`` with a free loopback port for the group."""

from __future__ import annotations

import socket
from collections.abc import Callable

import torch.multiprocessing as mp


def spawn_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args, port)`` in ``nprocs`` processes; ``port`` is free on 127.0.0.1 for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(fn, args=(*args, port), nprocs=nprocs)
