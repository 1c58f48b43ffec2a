"""The async TP ring's GEMMs in float8, for torchao ``Float8Linear`` modules (tensorwise scaling).

``Float8Gemms`` has the methods of ``async_tp._Gemms`` (the high-precision ones), so the ring code
is the same for both. Each operand is cast once with torchao's ``hp_tensor_to_float8_dynamic``
(the module's ``config`` gives the float8 dtypes, its ``linear_mm_config`` the GEMM settings) and
torchao's ``Float8TrainingTensor`` turns ``torch.mm`` into ``torch._scaled_mm``.

Scales are agreed over the TP group (an amax all-reduce per cast), as torchao's sync float8 TP
styles get them from DTensor: the input's amax over all sequence shards, the weight's over all
its shards, the output gradient's over all ranks' shards. So every ring chunk carries the one scale
that sync float8 TP would use, and the ring moves float8 bytes (viewed as uint8: gloo does not know
the float8 dtypes). Like the sync styles, the grad of the module's output (after the bias) is cast
before anything else sees it, so the bias grad is summed from the float8 grad.

Only tensorwise scaling: rowwise scales per token would have to travel with the chunks, and its
weight-gradient GEMM wants the input scaled along the sequence, i.e. across chunks of other ranks.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torchao.float8.config import Float8LinearConfig, Float8LinearRecipeName, ScalingGranularity, ScalingType
from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

_CAST_CONFIGS = (
    "cast_config_input",
    "cast_config_weight",
    "cast_config_grad_output",
    "cast_config_input_for_grad_weight",
    "cast_config_weight_for_grad_input",
    "cast_config_grad_output_for_grad_weight",
)
# role name used by the ring -> (torchao's role, the config field with its float8 dtype)
_ROLES = {
    "input": (GemmInputRole.INPUT, "cast_config_input"),
    "weight": (GemmInputRole.WEIGHT, "cast_config_weight"),
    "grad_output": (GemmInputRole.GRAD_OUTPUT, "cast_config_grad_output"),
}


def _recipe_name(config: Float8LinearConfig) -> str:
    for recipe in Float8LinearRecipeName:
        reference = Float8LinearConfig.from_recipe_name(recipe)
        if all(getattr(reference, f) == getattr(config, f) for f in _CAST_CONFIGS):
            return recipe.value
    return "custom"


def check_ring_float8(module: Float8Linear, style: str) -> None:
    """Raise NotImplementedError when ``module``'s float8 config is one the ring cannot run."""
    config = module.config
    tensorwise = all(
        getattr(config, f).scaling_type is ScalingType.DYNAMIC
        and getattr(config, f).scaling_granularity is ScalingGranularity.TENSORWISE
        for f in _CAST_CONFIGS
    )
    if not tensorwise:
        raise NotImplementedError(
            f"float8.recipe_name = {_recipe_name(config)!r} with experimental.enable_async_tensor_parallel: "
            f"{style}'s float8 ring supports tensorwise (dynamic) scaling only; use float8.recipe_name = "
            "'tensorwise', or turn async tensor parallel off"
        )
    if config.enable_fsdp_float8_all_gather:
        raise NotImplementedError(
            "float8.enable_fsdp_float8_all_gather with experimental.enable_async_tensor_parallel: the ring "
            "does not take FSDP's float8 weights yet; turn one of them off"
        )


def _rewrap(like: Float8TrainingTensor, data: Tensor) -> Float8TrainingTensor:
    """``data`` (a view, slice or copy of ``like``'s float8 bytes) with ``like``'s tensorwise scale."""
    return Float8TrainingTensor(data, like._scale, like._orig_dtype, like._linear_mm_config, like._gemm_input_role)


def _rows(t: Float8TrainingTensor) -> Float8TrainingTensor:
    return _rewrap(t, t._data.reshape(-1, t.shape[-1]))  # (tokens, features)


class Float8Gemms:
    """The ring's GEMMs for one ``Float8Linear``, its operands cast with TP-group scales."""

    float8 = True

    def __init__(self, module: Float8Linear, mesh: DeviceMesh) -> None:
        self.config = module.config
        self.mm_config = module.linear_mm_config
        self.mesh = mesh

    def cast(self, t: Tensor, role: str) -> Tensor:
        """``t`` in float8 with the scale of its amax over the TP group (as is, if already float8)."""
        if tensor_already_casted_to_fp8(t):
            return t
        gemm_role, field = _ROLES[role]
        return hp_tensor_to_float8_dynamic(
            t,
            getattr(self.config, field).target_dtype,
            self.mm_config,
            reduce_amax=True,
            gemm_input_role=gemm_role,
            device_mesh=self.mesh,
            round_scales_to_power_of_2=self.config.round_scales_to_power_of_2,
        )

    def to_wire(self, t: Float8TrainingTensor) -> Tensor:
        return t._data.view(torch.uint8)  # one byte per element; gloo has no float8 dtypes

    def from_wire(self, wire: Tensor, like: Float8TrainingTensor) -> Float8TrainingTensor:
        return _rewrap(like, wire.view(like._data.dtype))  # the scale is the group's: same on every rank

    def seq_chunk(self, t: Float8TrainingTensor, sl: slice) -> Float8TrainingTensor:
        return _rewrap(t, t._data[:, sl])

    def linear(self, x: Float8TrainingTensor, weight: Float8TrainingTensor) -> Tensor:
        y = torch.mm(_rows(x), weight.t())  # torch._scaled_mm, in x's high-precision dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    def grad_input(self, grad_y: Float8TrainingTensor, weight: Float8TrainingTensor) -> Tensor:
        grad_x = torch.mm(_rows(grad_y), weight)
        return grad_x.view(*grad_y.shape[:-1], grad_x.shape[-1])

    def add_grad_weight(self, grad_w: Tensor, grad_y: Float8TrainingTensor, x: Float8TrainingTensor) -> None:
        grad_w.add_(torch.mm(_rows(grad_y).t(), _rows(x)))

    def shared_linear(self, x_full: Tensor, weight: Tensor) -> Tensor:
        """Differentiable ``x_full @ weight^T`` for a linear sharing the ring's gathered float8 input."""
        # torchao's Float8Linear GEMM; given float8 operands it casts nothing itself.
        weight = self.cast(weight, "weight")  # torchao's cast passes the grad straight to weight
        return matmul_with_hp_or_float8_args.apply(x_full, weight.t(), self.mm_config, self.config)

    def output(self, y: Tensor) -> Tensor:
        return _CastGradOverGroup.apply(y, self)


class _CastGradOverGroup(torch.autograd.Function):
    """Identity forward; backward casts the grad to float8 with a TP-group scale.

    torchao's sync styles do the same to the module output (``NoopFwToFloat8BwDynamic`` on a
    DTensor); the GEMMs behind it take the float8 grad as it is.
    """

    @staticmethod
    def forward(ctx, t: Tensor, gemms: Float8Gemms) -> Tensor:
        ctx.gemms = gemms
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.gemms.cast(grad, "grad_output"), None
