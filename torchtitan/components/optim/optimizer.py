"""Optimizer and learning-rate schedule (the schedules' math: components/optim/lr_schedule.py)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.components.optim import local_shards
from torchtitan.components.optim.lr_schedule import lr_factor_fn
from torchtitan.components.optim.muon import MuonAdam, MuonLowPrecisionAdam
from torchtitan.components.optim.optim_lowp import LowPrecisionAdamW
from torchtitan.components.optim.param_groups import Group, assign_groups, canonical_name, format_group_table
from torchtitan.config.schema import Optimizer as OptimizerConfig
from torchtitan.config.schema import Training

logger = logging.getLogger(__name__)


def build_optimizer(model_parts: list[nn.Module], config: OptimizerConfig) -> torch.optim.Optimizer:
    """One optimizer over the trainable parameters of every model part (several with pipeline stages per rank), in
    the param groups of components/optim/param_groups.py; logs the group table once. A frozen parameter (LoRA's base)
    gets no optimizer state."""
    named = [
        (n, p) for part in model_parts for n, p in part.named_parameters() if p.requires_grad
    ]  # not LoRA's frozen base
    groups = assign_groups([(n, tuple(p.shape)) for n, p in named], config)
    logger.info("optimizer param groups (this rank's parameters):\n%s", format_group_table(groups))
    return _optimizer_over_groups(_torch_groups(groups, dict(named)), config)


def _torch_groups(groups: list[Group], params: dict[str, nn.Parameter]) -> list[dict[str, Any]]:
    by_canonical = {canonical_name(n): p for n, p in params.items()}
    out = []
    for g in groups:
        extra = {"decoupled_weight_decay": g.optimizer == "AdamW"} if g.optimizer != "Muon" else {}
        out.append({"params": [by_canonical[n] for n in g.names], "optimizer": g.optimizer, **g.settings, **extra})
    return out


def optimizer_over(params: list[nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    """One optimizer over ``params`` (the in-backward step's per-parameter optimizers): the groups' rules apply."""
    groups = assign_groups([(str(i), tuple(p.shape)) for i, p in enumerate(params)], _catch_all(config))
    by_name = {str(i): p for i, p in enumerate(params)}
    return _optimizer_over_groups(_torch_groups(groups, by_name), config)


def _catch_all(config: OptimizerConfig) -> OptimizerConfig:
    """The in-backward step's hooks see parameters without names: one rule, the section's settings."""
    return dataclasses.replace(config, param_groups=[], no_decay=[])


def _optimizer_over_groups(groups: list[dict[str, Any]], config: OptimizerConfig) -> torch.optim.Optimizer:
    kinds = {g["optimizer"] for g in groups}
    common = {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": config.eps}
    # bf16 parameters (training.dtype): the fp32 update of LowPrecisionAdamW, whatever the moments' dtype
    low_precision_params = any(p.dtype != torch.float32 for g in groups for p in g["params"])
    if config.state_dtype == "bfloat16" or low_precision_params:
        cls = MuonLowPrecisionAdam if "Muon" in kinds else LowPrecisionAdamW
        state_dtype = config.state_dtype or "float32"
        sr = config.bf16_stochastic_round
        return cls(groups, **common, weight_decay=config.weight_decay, state_dtype=state_dtype, stochastic_round=sr)
    if "Muon" in kinds:
        cls = MuonAdam
    elif kinds == {"Adam"}:
        cls = local_shards.Adam
    else:  # AdamW alone, as before; Adam and AdamW groups together: Adam with each group's decoupled_weight_decay
        # torch's classes, stepped on the DTensors' local shards (components/optim/local_shards.py)
        cls = local_shards.AdamW if kinds == {"AdamW"} else local_shards.Adam
    # foreach (multi-tensor) is the default; fused (torch's kernel, CUDA or CPU) only where asked.
    impl = {"fused": True} if config.fused else {"foreach": True}
    return cls(groups, **common, weight_decay=config.weight_decay, **impl)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: Training) -> LambdaLR:
    """The ``training.lr_schedule`` (components/optim/lr_schedule.py) over ``optimizer``'s groups."""
    return LambdaLR(optimizer, lr_factor_fn(config))


def apply_optimizer_config(
    optimizer: torch.optim.Optimizer, scheduler: LambdaLR, config: OptimizerConfig, model_parts: list[nn.Module]
) -> list[str]:
    """After a resume: the current config's hyper-parameters replace the checkpoint's; returns what changed.

    A checkpoint carries the optimizer's param groups and the schedule's base LR as they were saved;
    the config is the user's intent now: each group's settings are derived again from its rules. The schedule's
    position (its step) stays the checkpoint's, so the LR continues on the current config's curve at that step.

    Raises:
        ValueError: the config's rules make another number of groups than the checkpoint has.
    """
    named = [(n, tuple(p.shape)) for part in model_parts for n, p in part.named_parameters()]
    groups = assign_groups(named, config)
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"resume: the checkpoint's optimizer has {len(optimizer.param_groups)} param groups, the config's "
            f"optimizer.param_groups / no_decay make {len(groups)}; resume with the rules it was saved with"
        )
    changed = []
    for i, (g, group) in enumerate(zip(groups, optimizer.param_groups)):
        saved = {k: _plain(scheduler.base_lrs[i] if k == "lr" else group.get(k)) for k in g.settings}
        prefix = "optimizer." if len(groups) == 1 else f"optimizer group {i} "
        changed += [f"{prefix}{k} {saved[k]} -> {v}" for k, v in g.settings.items() if saved[k] != v]
        group.update({k: v for k, v in g.settings.items() if k != "lr"})
        group["initial_lr"] = g.settings["lr"]
        group["lr"] = g.settings["lr"] * scheduler.lr_lambdas[i](scheduler.last_epoch)
    scheduler.base_lrs = [g.settings["lr"] for g in groups]
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return changed


def _plain(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v
