"""YaRN RoPE scaling, as transformers computes it (``rope_type = "yarn"``, ``_compute_yarn_parameters``).

Below the families that use it (deepseek_v3 as ``DeepSeekV3Args.rope_scaling``, gpt_oss as
``GptOssArgs.yarn``): one dataclass, the frequencies, the cos/sin multiplier and the RoPE table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (HF ``rope_scaling = {"rope_type": "yarn", ...}``); the defaults are transformers'.

    Rotation frequencies with fewer than ``beta_slow`` turns over ``original_max_seq_len`` tokens are
    divided by ``factor`` (interpolated), those with more than ``beta_fast`` turns kept, and the ones in
    between blended linearly over the dimensions; ``truncate`` rounds that range outwards to whole
    dimensions. cos and sin are multiplied by ``attention_factor`` (which scales q and k alike, so every
    score by its square); unset, it is m(factor, mscale) / m(factor, mscale_all_dim) where both are
    given, else m(factor, 1), with m(f, s) = 0.1 * s * ln(f) + 1. A 0 reads as "not given", as in
    transformers. DeepSeek's MLA also scales the softmax by m(factor, mscale_all_dim)^2 (its args.py).
    """

    factor: float
    original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: not given
    mscale_all_dim: float = 0.0  # 0: not given
    attention_factor: float | None = None  # None: from mscale / mscale_all_dim as above
    truncate: bool = True  # round the blended dimension range outwards to whole dimensions


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's temperature term m(factor, mscale) = 0.1 * mscale * ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(yarn: YarnScaling) -> float:
    """What cos and sin are multiplied by (transformers' ``attention_factor`` for yarn)."""
    if yarn.attention_factor is not None:
        return yarn.attention_factor
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor, 1.0)


def compute_yarn_freqs(dim: int, theta: float, yarn: YarnScaling) -> torch.Tensor:
    """(dim/2,) rotation frequencies under YaRN, in the float32 steps of transformers' ``_compute_yarn_parameters``."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (dim/2,)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:  # the dimension turning this often in the original context
        return (dim * math.log(yarn.original_max_seq_len / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast or 32), correction_dim(yarn.beta_slow or 1)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # (dim/2,)
    keep = 1 - ramp  # 1: the frequency is kept (extrapolated), 0: divided by factor (interpolated)
    return interpolation * (1 - keep) + extrapolation * keep


def compute_yarn_rope_cache(dim: int, max_seq_len: int, theta: float, yarn: YarnScaling) -> torch.Tensor:
    """(max_seq_len, dim): [cos | sin] of YaRN's angles times its attention factor (llama's table layout)."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), compute_yarn_freqs(dim, theta, yarn))
    return torch.cat([angles.cos(), angles.sin()], dim=-1) * yarn_attention_factor(yarn)  # (seq, dim)
