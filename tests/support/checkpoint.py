"""Checkpoint managers on one process for the unit tests: a tiny Llama's and a single linear's, and what they load.

No process group: DCP runs in this process (it assumes one process on every call).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.checkpointing.manager import CheckpointManager
from torchtitan.config.schema import Checkpoint as CheckpointConfig
from torchtitan.models.llama import ModelArgs, Transformer

ARGS = ModelArgs(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16, rope_theta=500000
)


class StubLoader:
    def __init__(self):
        self.state = {"num_streams": 1, "seq_len": 4, "streams": {"0": {"docs": 3, "windows": 2, "buffer": [1]}}}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def tiny_manager(
    tmp_path, model: torch.nn.Module, clock=None, before_marker=None, optimizer=torch.optim.AdamW, **config
) -> CheckpointManager:
    opt = optimizer(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    cfg = CheckpointConfig(enable_checkpoint=True, folder="ckpt", **{"interval": 2, **config})
    return CheckpointManager(
        cfg,
        dump_folder=str(tmp_path),
        model_parts=[model],
        optimizer=opt,
        lr_scheduler=sched,
        data_loader=StubLoader(),
        dp_rank=0,
        rank=0,
        device=torch.device("cpu"),
        model_info={"args": dataclasses.asdict(ARGS)},
        **({"clock": clock} if clock else {}),
        before_marker=before_marker,
    )


def tiny_llama(seed: int, args: ModelArgs = ARGS) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


def tiny_train_step(model: Transformer, manager: CheckpointManager) -> None:
    tokens = torch.arange(16).view(2, 8) % ARGS.vocab_size
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    manager.optimizer.step()
    manager.lr_scheduler.step()
    manager.optimizer.zero_grad()


DATA = "__0_0.distcp"


def tiny_linear(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(64, 64)  # 16 KiB of weights: most of the data file is tensor bytes


def linear_manager(tmp_path, model: nn.Module, *, folder: str = "ckpt", **config) -> CheckpointManager:
    """A one-process manager of ``model`` saving to ``<tmp_path>/<folder>`` (a URL folder: there)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return CheckpointManager(
        CheckpointConfig(enable_checkpoint=True, folder=folder, **config),
        dump_folder=str(tmp_path),
        model_parts=[model],
        optimizer=opt,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        data_loader=StubLoader(),
        dp_rank=0,
        rank=0,
        device=torch.device("cpu"),
        model_info={"name": "linear", "flavor": None, "args": {"dim": 64}},
    )


class Pwn:
    """Unpickling this runs a shell command: what a crafted checkpoint would carry."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return os.system, (f"touch {self.target}",)
