"""float8 in the build (docs/float8.md): the ``model_transform`` that converts the linears (before the parallelisms:
TP picks float8 styles for converted linears) and the ``step_hooks`` that precompute the FSDP float8 scales."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from torchtitan.components.seams import ModelTransform
from torchtitan.features.float8.float8 import (
    Float8ScalePrecompute,
    apply_float8,
    check_float8_runs,
    cpu_float8_onednn_problem,
    turn_off_onednn,
)

if TYPE_CHECKING:
    import torch

    from torchtitan.config.manager import JobConfig
    from torchtitan.config.schema import Float8
    from torchtitan.spec import ModelSpec


class Float8Transform(ModelTransform):
    """Every float8-friendly linear of a meta model (or stage) becomes torchao's ``Float8Linear``."""

    def __init__(self, float8: Float8):
        self.float8 = float8

    def convert(self, part: nn.Module) -> None:
        apply_float8(part, self.float8)


def build_float8_transform(config: JobConfig, spec: ModelSpec, device: torch.device) -> Float8Transform:
    """Checks once that float8 GEMMs run on ``device``; on CPU, turns oneDNN off for the process where its float8
    GEMM is broken or slow there (the probes measure, the build decides)."""
    check_float8_runs(device, config.float8.recipe_name)
    if device.type == "cpu" and (problem := cpu_float8_onednn_problem()) is not None:
        turn_off_onednn(problem)
    return Float8Transform(config.float8)


def build_scale_precompute(config: JobConfig, model_parts: list[nn.Module]) -> Float8ScalePrecompute:
    return Float8ScalePrecompute(model_parts)
