"""LoRA: a linear layer with a frozen base weight and a trainable low-rank update (Hu et al. 2021).

``y = x W^T + b + (alpha / rank) * B(A(dropout(x)))`` with ``A: (rank, in)`` and ``B: (out, rank)``.
The module *is* an ``nn.Linear`` (its own ``weight`` / ``bias`` are the base's, under the base's names,
so checkpoints and Hugging Face conversions of the base see the same keys); the adapters are the child
linears ``lora_a`` and ``lora_b``. PEFT's default init (``init_lora_weights = True``): A Kaiming-uniform
(a = sqrt(5), nn.Linear's own), B zero, so a fresh adapter adds exactly 0 and the model equals its base.

Which linears get adapters, freezing and the parallel styles (tensor_parallel.py, asked for through
``parallel_style_for``) live beside it in torchtitan/features/lora/.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def is_adapter_key(fqn: str) -> bool:
    """A parameter / state-dict key of an adapter weight (``layers.0.attention.wq.lora_a.weight``)."""
    return ".lora_a." in fqn or ".lora_b." in fqn


def is_base_key(fqn: str) -> bool:
    return not is_adapter_key(fqn)


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` (the frozen base) plus the low-rank adapter ``lora_b(lora_a(dropout(x))) * scaling``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank  # PEFT's default (not rsLoRA's alpha / sqrt(rank))
        self.lora_a = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_b = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def parallel_style_for(self, style):
        """Under TP: the plan's Colwise/Rowwise style's twin that shards the adapters alike (lora/tensor_parallel.py)."""
        from torchtitan.features.lora.tensor_parallel import twin_style  # the distributed stack only when TP shards it

        return twin_style(style)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, rank: int, alpha: float, dropout: float = 0.0) -> LoRALinear:
        """A LoRALinear whose base is ``linear``'s parameters (the same tensors, not copies)."""
        w = linear.weight
        new = cls(
            linear.in_features,
            linear.out_features,
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            bias=linear.bias is not None,
            device=w.device,
            dtype=w.dtype,
        )
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    @torch.no_grad()
    def init_adapter(self) -> None:
        """PEFT's default: A as nn.Linear's own init (Kaiming-uniform, a = sqrt(5)), B zero."""
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)  # (..., out)
        update = self.lora_b(self.lora_a(self.lora_dropout(x)))  # (..., rank) -> (..., out)
        return base + update * self.scaling

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The base weight with the adapter folded in: ``W + scaling * B @ A`` (out, in)."""
        return self.weight + self.scaling * (self.lora_b.weight @ self.lora_a.weight)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"
