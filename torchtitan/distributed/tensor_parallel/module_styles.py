"""A module that shards its own way under TP: the plan's style for it, swapped for the one it asks for.

A module whose parameters are not a plain linear's (a LoRA linear's adapters, for one) says how a plan style
shards it (``parallel_style_for``): the same input and output layouts, its own parameters placed alike. The plan
stays written for plain modules and names no feature.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle


@runtime_checkable
class ShardsItsOwnWay(Protocol):
    def parallel_style_for(self, style: ParallelStyle) -> ParallelStyle:
        """The style that shards this module as ``style`` shards a plain one (same layouts)."""


def with_module_styles(plan: dict[str, ParallelStyle], module: nn.Module) -> dict[str, ParallelStyle]:
    """``plan`` (keys: submodules of ``module``) with each target that shards its own way given its own style."""
    out = dict(plan)
    for key, style in plan.items():
        target = _submodule(module, key)
        if isinstance(target, ShardsItsOwnWay):
            out[key] = target.parallel_style_for(style)
    return out


def _submodule(module: nn.Module, key: str) -> nn.Module | None:
    try:
        return module.get_submodule(key)
    except AttributeError:
        return None
