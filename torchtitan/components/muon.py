"""Muon beside Adam/AdamW in one optimizer, on plain tensors and on DTensors (FSDP2, TP, EP, their products).

The math is ``torch.optim.Muon``'s (torch 2.13, ``torch/optim/_muon.py``), op for op: the momentum buffer
``B = lerp(B, g, 1 - mu)``, the Nesterov update ``lerp(g, B, mu)``, the Newton-Schulz iteration in bfloat16
(``compute_orthogonalized``), decoupled weight decay ``p *= 1 - lr * wd``, then ``p -= adjust_lr(lr, shape) * O``.

Distributed: the momentum buffer is created like the gradient (a DTensor with the parameter's placements), so it
is sharded like the parameter and DCP saves it sharded. The elementwise momentum runs on the local shards; the
orthogonalisation needs the whole matrix, so the Nesterov update is all-gathered (``full_tensor``) and every
rank runs Newton-Schulz on the full matrix (an expert stack: per expert) and keeps its own shard of the result.
The alternative, each matrix assigned to one rank round-robin and its result scattered back, runs each matrix
once in the world instead of once per rank, but needs a second exchange; docs/performance.md has the
measurement behind this choice.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.components.optim_lowp import LowPrecisionAdamW
from torchtitan.distributed.dtensor import local_shard


def compute_orthogonalized(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float):
    """Newton-Schulz orthogonalisation of one matrix, as torch.optim.Muon's ``_zeropower_via_newtonschulz``."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def compute_adjusted_lr(lr: float, adjust_lr_fn: str, shape: tuple[int, ...]) -> float:
    """torch.optim.Muon's shape-dependent lr: 'original' sqrt(max(1, A/B)), 'match_rms_adamw' 0.2 sqrt(max(A, B))."""
    rows, cols = shape[-2:]  # an expert stack: each expert's matrix
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


def _orthogonalize(full: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    args = (tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"])
    if full.ndim == 2:
        return compute_orthogonalized(full, *args)
    return torch.stack([compute_orthogonalized(m, *args) for m in full.unbind(0)])  # one per expert


class _MuonGroups:
    """Mixin over an Adam class: groups whose ``optimizer`` is "Muon" take Muon's step, the rest the base's."""

    param_groups: list[dict[str, Any]]
    state: Any

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        # The base class's step walks self.param_groups: show it only the Adam groups, for that call.
        self.param_groups = [g for g in groups if g["optimizer"] != "Muon"]
        try:
            super().step()  # type: ignore[misc]
        finally:
            self.param_groups = groups
        for group in groups:
            if group["optimizer"] == "Muon":
                for p in group["params"]:
                    if p.grad is not None:
                        self._muon_update(p, group)
        return loss

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A load_state_dict ends here; Adam's own __setstate__ expects Adam's state in every group it walks.
        groups = state["param_groups"]
        super().__setstate__({**state, "param_groups": [g for g in groups if g.get("optimizer") != "Muon"]})
        self.param_groups = groups

    def _muon_update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        grad = p.grad
        if isinstance(p, DTensor) and grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)  # e.g. a Partial gradient under plain TP
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf, g = local_shard(state["momentum_buffer"]), local_shard(grad)
        momentum = group["momentum"]
        buf.lerp_(g, 1 - momentum)
        update = g.lerp(buf, momentum) if group["nesterov"] else buf
        if isinstance(p, DTensor):
            whole = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            ortho = _orthogonalize(whole.full_tensor(), group)
            # Every rank holds the same full result; each keeps its own shard (no communication).
            ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None).to_local()
        else:
            ortho = _orthogonalize(update, group)
        lr, wd = group["lr"], group["weight_decay"]
        param = local_shard(p)
        param.mul_(1 - lr * wd)
        param.add_(ortho, alpha=-compute_adjusted_lr(lr, group["adjust_lr_fn"], tuple(p.shape)))


class MuonAdam(_MuonGroups, torch.optim.Adam):
    """Muon groups beside Adam/AdamW groups (each group's ``decoupled_weight_decay``: AdamW or Adam)."""


class MuonLowPrecisionAdam(_MuonGroups, LowPrecisionAdamW):
    """Muon groups beside the bf16-state Adam/AdamW groups (optimizer.state_dtype = "bfloat16")."""
