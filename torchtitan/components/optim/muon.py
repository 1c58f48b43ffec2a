"""Muon beside Adam/AdamW in one optimizer, on plain tensors and on DTensors (FSDP2, TP, EP, their products).

The math is ``torch.optim.Muon``'s (torch 2.13, ``torch/optim/_muon.py``), op for op: the momentum buffer
``B = lerp(B, g, 1 - mu)``, the Nesterov update ``lerp(g, B, mu)``, the Newton-Schulz iteration in bfloat16
(``compute_orthogonalized``), decoupled weight decay ``p *= 1 - lr * wd``, then ``p -= adjust_lr(lr, shape) * O``.

Distributed: the momentum buffer is created like the gradient (a DTensor with the parameter's placements), so it
is sharded like the parameter and DCP saves it sharded. The elementwise momentum runs on the local shards; the
orthogonalisation needs the whole matrix (an expert stack: each expert's), orthogonalised once per step. On a
mesh with one axis of size > 1 and a plain shard on it (FSDP, TP or EP alone) the matrices are assigned to ranks
round-robin (components/optim/muon_round_robin.py: gather to the owner, scatter the result back); on other meshes
(FSDP x TP, HSDP) every rank all-gathers the update, orthogonalises the whole matrix and keeps its own shard.
Both give bit-identical results; bench/muon.py measured round-robin faster on FSDP2 (docs/performance.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.components.optim import local_shards
from torchtitan.components.optim.muon_round_robin import RoundRobin
from torchtitan.components.optim.optim_lowp import LowPrecisionAdamW
from torchtitan.distributed.backend.dtensor import in_layout_of, local_shard


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
    round_robin = True
    """False: every matrix takes the all-gather path (bench/muon.py times both)."""

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
        items = [(p, g) for g in groups if g["optimizer"] == "Muon" for p in g["params"] if p.grad is not None]
        assigned = RoundRobin(_orthogonalize)
        for p, group in items:
            update = self._momentum(p, group)
            if self.round_robin and assigned.takes(p):
                assigned.send(p, group, update)
            else:
                _apply(p, group, _orthogonalize_whole(p, update, group))
        for p, group, ortho in assigned.finish():
            _apply(p, group, ortho)
        return loss

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A load_state_dict ends here; Adam's own __setstate__ expects Adam's state in every group it walks.
        groups = state["param_groups"]
        super().__setstate__({**state, "param_groups": [g for g in groups if g.get("optimizer") != "Muon"]})
        self.param_groups = groups

    def _momentum(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The momentum step on this rank's shard; returns the (Nesterov) update's shard."""
        grad = in_layout_of(p, p.grad)  # e.g. a Partial gradient under plain TP
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf, g = local_shard(state["momentum_buffer"]), local_shard(grad)
        momentum = group["momentum"]
        buf.lerp_(g, 1 - momentum)
        return g.lerp(buf, momentum) if group["nesterov"] else buf


def _orthogonalize_whole(p: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Gather: every rank all-gathers the update and orthogonalises the whole matrix, keeping its own shard."""
    if not isinstance(p, DTensor):
        return _orthogonalize(update, group)
    whole = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    ortho = _orthogonalize(whole.full_tensor(), group)
    # Every rank holds the same full result; each keeps its own shard (no communication).
    return distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None).to_local()


def _apply(p: torch.Tensor, group: dict[str, Any], ortho: torch.Tensor) -> None:
    lr, wd = group["lr"], group["weight_decay"]
    param = local_shard(p)
    param.mul_(1 - lr * wd)
    param.add_(ortho, alpha=-compute_adjusted_lr(lr, group["adjust_lr_fn"], tuple(p.shape)))


class MuonAdam(_MuonGroups, local_shards.Adam):
    """Muon groups beside Adam/AdamW groups (each group's ``decoupled_weight_decay``: AdamW or Adam), those stepped
    on local shards (components/optim/local_shards.py)."""


class MuonLowPrecisionAdam(_MuonGroups, LowPrecisionAdamW):
    """Muon groups beside the bf16-state Adam/AdamW groups (optimizer.state_dtype = "bfloat16")."""
