"""The kernel Gated DeltaNet's chunked rule runs (``model.linear_attention_kernel``): our torch form, or
flash-linear-attention's Triton kernel on CUDA where that package is installed (the optional extra ``fla``).

The model never imports fla: each Gated DeltaNet layer calls its ``chunk_rule`` attribute (the torch form by
default, models/qwen3_5/gated_delta.py), which ``install_linear_attention_kernel`` points at ``fla_chunk_rule``
here. Both take and return the same tensors: q, k (bs, T, Hk, dk), v (bs, T, H, dv), g (log decay) and beta
(bs, T, H), an optional initial state (bs, H, dk, dv) -> (out in v's dtype, the final state in fp32); q and k are
L2-normalised and q scaled by dk^-0.5 inside either.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.qwen3_5.gated_delta import repeat_to_value_heads

logger = logging.getLogger(__name__)

KERNELS = ("torch", "fla")
FLA_INSTALL = "pip install flash-linear-attention (the optional extra: pip install -e '.[fla]')"


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def resolve_linear_attention_kernel(requested: str, device_type: str) -> str:
    """``model.linear_attention_kernel`` -> the kernel Gated DeltaNet runs on ``device_type``.

    Raises:
        ValueError: an unknown kernel, or "fla" where it cannot run (not CUDA, or the package missing).
    """
    if requested == "auto":
        return "fla" if device_type == "cuda" and fla_installed() else "torch"  # device-choice: Triton kernels
    if requested not in KERNELS:
        raise ValueError(f"model.linear_attention_kernel = {requested!r}: allowed are 'auto', 'torch', 'fla'")
    if requested == "fla" and device_type != "cuda":  # device-choice: Triton kernels
        raise ValueError(
            f"model.linear_attention_kernel = 'fla' needs CUDA (flash-linear-attention's kernels are Triton), this "
            f"run is on {device_type!r}; use 'torch' or 'auto'"
        )
    if requested == "fla" and not fla_installed():
        raise ValueError(
            f"model.linear_attention_kernel = 'fla': flash-linear-attention is not installed; {FLA_INSTALL}"
        )
    return requested


def fla_chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = 64,
    state: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunked_gated_delta_rule``'s contract on fla's ``chunk_gated_delta_rule`` (its chunk is its own: 64, the
    same as transformers'). q and k are repeated to the value heads first (any fla version takes equal heads).
    Documents: the rows are packed into one sequence cut at every row and document start (fla's ``cu_seqlens``);
    the final state returned is then the last document's."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k = repeat_to_value_heads(q, k, v.shape[2], dim=2)
    shape, varlen = v.shape, {}
    if doc_ids is not None:  # (1, bs * T, ...) and the start of every document
        q, k, v, g, beta = (x.flatten(0, 1)[None] for x in (q, k, v, g, beta))
        starts = F.pad(doc_ids[:, 1:] != doc_ids[:, :-1], (1, 0), value=True).flatten()  # rows start documents too
        bounds = torch.cat([starts.nonzero().flatten(), starts.new_tensor([starts.numel()], dtype=torch.long)])
        varlen = {"cu_seqlens": bounds}
    out, final = chunk_gated_delta_rule(
        q,
        k,
        v,
        g=g.float(),
        beta=beta,
        initial_state=None if state is None else state.float(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,  # and its default scale, dk^-0.5
        **varlen,
    )
    return out.reshape(shape).to(v.dtype), None if final is None else final.float()


def install_linear_attention_kernel(model: nn.Module, requested: str, device: torch.device) -> None:
    """Point every Gated DeltaNet layer of ``model`` (a module with a ``chunk_rule``) at the resolved kernel; a model
    without one is left alone. One log line names the kernel."""
    layers = [m for m in model.modules() if hasattr(m, "chunk_rule")]
    if not layers:
        return
    kernel = resolve_linear_attention_kernel(requested, device.type)
    if kernel == "fla":
        for layer in layers:
            layer.chunk_rule = fla_chunk_rule
    why = ""
    if requested == "auto":
        why = " (auto: flash-linear-attention on CUDA" + ("" if fla_installed() else ", not installed") + ")"
    _log_kernel_once(kernel, why)


@functools.cache
def _log_kernel_once(kernel: str, why: str) -> None:
    what = "flash-linear-attention's Triton kernel" if kernel == "fla" else "the torch chunked form"
    logger.info("Gated DeltaNet's chunked rule runs %s%s", what, why)


class LinearAttentionKernel:
    """The model transform (the registry's ``model_transform`` slot) that points every Gated DeltaNet layer at
    ``model.linear_attention_kernel``'s kernel; a model without such layers is left alone."""

    def __init__(self, requested: str, device: torch.device):
        self.requested, self.device = requested, device

    def convert(self, part: nn.Module) -> None:
        install_linear_attention_kernel(part, self.requested, self.device)

    def after_init(self, part: nn.Module, seed: int) -> None:
        pass


def build_kernel_transform(config: Any, spec: Any, device: torch.device) -> LinearAttentionKernel:
    """The transform of ``config.model.linear_attention_kernel`` (``config``: the job's config)."""
    return LinearAttentionKernel(config.model.linear_attention_kernel, device)
