"""``trunc_normal_`` as torch 2.12 and later draw it, on every supported torch: the seam for weight init.

torch 2.12 changed how ``nn.init.trunc_normal_`` samples. 2.11 maps a uniform draw through the inverse
normal CDF; 2.12 and later draw a normal and redraw the values outside [a, b] (or, for a range narrower
than about 0.3 of the mass, accept uniform proposals by the density). Same distribution, other values:
one seed gave other initial weights on 2.11 (the debug model's first loss 8.331 instead of 8.145). Every
model here initialises through this function: torch's own on 2.12 and later (bit-identical), the same
algorithm op for op on 2.11, so a seed gives the same weights on every supported release.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.torch_version import TorchVersion

_TORCH_REDRAWS = TorchVersion(torch.__version__) >= (2, 12)
# Parameter dtypes whose initial values are drawn in fp32 and rounded (training.dtype = "bfloat16").
LOW_PRECISION = (torch.bfloat16, torch.float16)


def trunc_normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0):
    """Fill ``tensor`` from N(mean, std^2) truncated to [a, b], as ``nn.init.trunc_normal_`` of torch >= 2.12.

    A bf16 tensor (training.dtype) gets the fp32 draws rounded: the redraws test the range on fp32 values, so a
    value that rounding would move across a bound does not change which draws follow (nor the weights after)."""
    if tensor.dtype in LOW_PRECISION and not tensor.is_meta:
        wide = torch.empty_like(tensor, dtype=torch.float32)
        trunc_normal_(wide, mean=mean, std=std, a=a, b=b)
        with torch.no_grad():
            return tensor.copy_(wide)
    if _TORCH_REDRAWS:
        return nn.init.trunc_normal_(tensor, mean=mean, std=std, a=a, b=b)
    return _redrawn_trunc_normal_(tensor, mean, std, a, b)


@torch.no_grad()
def _redrawn_trunc_normal_(tensor: torch.Tensor, mean: float, std: float, a: float, b: float) -> torch.Tensor:
    """torch 2.13's ``nn.init._no_grad_trunc_normal_`` (BSD-3-Clause, the PyTorch authors), without its generator."""
    if tensor.is_meta:
        return tensor
    if is_fake(tensor):  # no values to test against the range: the estimator's fake build fills as 2.13's does there
        return tensor.normal_(mean, std)
    p = _norm_cdf((b - mean) / std) - _norm_cdf((a - mean) / std)
    if p > 0.3:
        lo, hi = tensor.new_tensor(a, device="cpu").item(), tensor.new_tensor(b, device="cpu").item()
        result = tensor.normal_(mean, std)
        while True:
            mask = (result < lo) | (result > hi)
            if not mask.any():
                break
            result = torch.where(mask, torch.empty_like(result).normal_(mean, std), result)
        if tensor is not result:
            tensor.copy_(result)
        return tensor
    log_peak = -0.5 * ((max(a, min(mean, b)) - mean) / std) ** 2
    candidates, accept_buf = torch.empty_like(tensor), torch.empty_like(tensor)
    tensor.uniform_(a, b)
    candidates.copy_(tensor)
    candidates.sub_(mean).div_(std).pow_(2).mul_(-0.5).sub_(log_peak)  # the log density, less its peak
    pending = accept_buf.uniform_().log_().gt(candidates)
    if pending.any():
        result = tensor
        while True:
            candidates.uniform_(a, b)
            result = torch.where(pending, candidates, result)
            candidates.sub_(mean).div_(std).pow_(2).mul_(-0.5).sub_(log_peak)
            pending = torch.where(pending, accept_buf.uniform_().log_().gt(candidates), pending)
            if not pending.any():
                break
        tensor.copy_(result)
    return tensor


def _norm_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0
