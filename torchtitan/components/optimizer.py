"""Optimizer and learning-rate schedule (the schedules' math: components/lr_schedule.py)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.components.lr_schedule import lr_factor_fn
from torchtitan.components.optim_lowp import LowPrecisionAdamW
from torchtitan.components.optimizer_in_backward import OptimizerInBackward
from torchtitan.config.schema import Optimizer as OptimizerConfig
from torchtitan.config.schema import Training

logger = logging.getLogger(__name__)


def build_optimizer(model_parts: list[nn.Module], config: OptimizerConfig) -> torch.optim.Optimizer:
    """One optimizer over the trainable parameters of every model part (several with pipeline stages per rank);
    a frozen parameter (LoRA's base) gets no optimizer state."""
    return _optimizer_over([p for part in model_parts for p in part.parameters() if p.requires_grad], config)


def build_optimizer_in_backward(
    optimizer: torch.optim.Optimizer,
    config: OptimizerConfig,
    *,
    pipeline_microbatches: int,
    fsdp: bool,
    pp_group: dist.ProcessGroup | None,
) -> OptimizerInBackward:
    """The per-parameter steps in backward over ``optimizer``'s parameters (``optimizer.early_step_in_backward``).

    ``pipeline_microbatches``: 1 without pipeline parallel. Without FSDP every micro-batch's backward
    accumulates into a stage's gradients; FSDP's hook fires once, after its reduce-scatter.
    """
    in_backward = OptimizerInBackward(
        optimizer,
        lambda params: _optimizer_over(params, config),
        grads_per_step=1 if fsdp else pipeline_microbatches,
        grad_divisor=pipeline_microbatches,
        norm_groups=[pp_group] if pp_group is not None else [],
    )
    logger.info(
        "optimizer steps in backward: each of this rank's %d parameters is stepped by a hook as soon as its "
        "gradient is final, and the gradient freed",
        len(in_backward.one),
    )
    return in_backward


def _optimizer_over(params: list[nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    if config.state_dtype == "bfloat16":
        return LowPrecisionAdamW(
            params,
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.eps,
            weight_decay=config.weight_decay,
            decoupled_weight_decay=config.name == "AdamW",
            state_dtype="bfloat16",
        )
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[config.name]
    # foreach (multi-tensor) is the default; fused only where asked (a CUDA kernel).
    impl = {"fused": True} if config.fused else {"foreach": True}
    return cls(
        params,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        **impl,
    )


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: Training) -> LambdaLR:
    """The ``training.lr_schedule`` (components/lr_schedule.py) over ``optimizer``'s groups."""
    return LambdaLR(optimizer, lr_factor_fn(config))


def apply_optimizer_config(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, config: OptimizerConfig) -> list[str]:
    """After a resume: the current config's hyper-parameters replace the checkpoint's; returns what changed.

    A checkpoint carries the optimizer's param groups and the schedule's base LR as they were saved;
    the config is the user's intent now. The schedule's position (its step) stays the checkpoint's,
    so the LR continues on the current config's curve at that step.
    """
    wanted = {
        "lr": config.lr,
        "betas": (config.beta1, config.beta2),
        "eps": config.eps,
        "weight_decay": config.weight_decay,
    }
    first = optimizer.param_groups[0]
    saved = {"lr": scheduler.base_lrs[0], "betas": tuple(first["betas"]), "eps": first["eps"]}
    saved["weight_decay"] = first["weight_decay"]
    changed = [f"optimizer.{k} {saved[k]} -> {v}" for k, v in wanted.items() if saved[k] != v]
    for i, group in enumerate(optimizer.param_groups):
        group.update({k: v for k, v in wanted.items() if k != "lr"})
        group["initial_lr"] = config.lr
        group["lr"] = config.lr * scheduler.lr_lambdas[i](scheduler.last_epoch)
    scheduler.base_lrs = [config.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return changed
