"""Pool jobs of activation_checkpoint.mode = 'memory_budget' (tests/runs/training/test_memory_options.py): the bytes
each step saves for backward, in a compiled trainer run and in the memory estimator's tracked step of the same config."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor


class SavedBytes:
    """A saved-tensor hook pair that adds up the bytes of every real tensor autograd saves for backward."""

    def __init__(self):
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, FakeTensor):  # compile's tracing of the joint graph saves fake ones
            self.total += t.numel() * t.element_size()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def saved_bytes_job(rank: int, world_size: int, argv: list[str], estimator: bool) -> dict:
    """The trainer's run of ``argv`` (``estimator``: the estimator's tracked real step of it instead, two steps) under
    ``SavedBytes``: {"bytes": saved over the run, "steps": steps run, "error": the job's error or None}."""
    from tests.support.pool import train_job
    from torchtitan.config.manager import JobConfig
    from torchtitan.estimation.estimate import estimate_rank
    from torchtitan.estimation.fake_trainer import resolve_vocab

    saved = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        if estimator:
            config = JobConfig.parse_args(argv)
            estimate_rank(config, world_size, rank, resolve_vocab(config)[0], fake=False)
            return {"bytes": saved.total, "steps": 2, "error": None}
        failed = train_job(rank, world_size, argv)
    steps = JobConfig.parse_args(argv).training.steps
    return {"bytes": saved.total, "steps": steps, "error": None if failed is None else failed.error}
