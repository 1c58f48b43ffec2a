"""DTensor helpers shared across packages (a leaf: imports only torch)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, else ``t`` itself.

    The DTensor's own local tensor, not a copy or view: in-place writes land in the DTensor. Not
    differentiable, so for code under ``no_grad`` (optimizer updates) or inside DTensor dispatch.
    Code that needs gradients through the shard calls ``DTensor.to_local()`` instead (as the MoE
    experts do, duck-typed, in models/moe/moe.py).
    """
    return t._local_tensor if isinstance(t, DTensor) else t


def in_layout_of(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``p``'s placements (e.g. a Partial gradient nobody reduced yet, redistributed as DTensor's dispatch
    would), so an elementwise update can run on the two local shards; ``grad`` itself when they already match."""
    if isinstance(p, DTensor) and grad.placements != p.placements:
        return grad.redistribute(p.device_mesh, p.placements)
    return grad
