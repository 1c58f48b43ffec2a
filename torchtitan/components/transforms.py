"""The model transforms of the core training options (the registry's ``model_transform`` slot, beside the
features' own): the parameters' dtype (``training.dtype``) and the vision tower's freeze (``model.freeze_vision``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from torchtitan.components.seams import ModelTransform
from torchtitan.distributed.init import cast_parameters_
from torchtitan.dtypes import to_dtype

if TYPE_CHECKING:
    import torch

    from torchtitan.config.manager import JobConfig
    from torchtitan.spec import ModelSpec


class ParameterCast(ModelTransform):
    """Pure low-precision training: every floating parameter stored in ``dtype`` before FSDP/TP wrap them, so every
    layout holds the same low-precision tensors."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def convert(self, part: nn.Module) -> None:
        cast_parameters_(part, self.dtype)


class VisionFreeze(ModelTransform):
    """The vision tower stops training (its merger trains): the family's check allows it only on a model with one."""

    def convert(self, part: nn.Module) -> None:
        part.freeze_vision()


def build_parameter_cast(config: JobConfig, spec: ModelSpec, device: torch.device) -> ParameterCast:
    return ParameterCast(to_dtype(config.training.dtype))


def build_vision_freeze(config: JobConfig, spec: ModelSpec, device: torch.device) -> VisionFreeze:
    return VisionFreeze()
