"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): the residual is ``hc_mult`` streams (bs, n, hc, dim)
that each sub-block collapses into its input and spreads its output back into, mixing them through a doubly
stochastic matrix (Sinkhorn-Knopp), so the residual map stays non-expansive however deep the stack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.init import trunc_normal_
from torchtitan.models.deepseek_v4.args import DeepSeekV4Args


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection around one sub-block: from the ``hc_mult`` residual streams
    (bs, n, hc, dim), a linear map of their RMS-normalised concatenation gives ``pre`` (how the streams collapse
    into the sub-block's input), ``post`` (how its output spreads back) and ``comb`` (how the streams mix, made
    doubly stochastic by Sinkhorn-Knopp). transformers' ``DeepseekV4HyperConnection``; fp32 throughout."""

    def __init__(self, args: DeepSeekV4Args):
        super().__init__()
        hc = args.hc_mult
        self.hc, self.iters, self.eps, self.norm_eps = hc, args.hc_sinkhorn_iters, args.hc_eps, args.norm_eps
        self.fn = nn.Parameter(torch.empty((2 + hc) * hc, hc * args.dim))
        self.base = nn.Parameter(torch.empty((2 + hc) * hc))
        self.scale = nn.Parameter(torch.empty(3))

    def init_weights(self) -> None:
        trunc_normal_(self.fn, mean=0.0, std=0.02)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h (bs, n, hc, dim) -> post (bs, n, hc), comb (bs, n, hc, hc) fp32, and the collapsed input (bs, n, dim)."""
        hc = self.hc
        flat = h.flatten(2).float()  # (bs, n, hc * dim)
        mixes = F.linear(F.rms_norm(flat, (flat.shape[-1],), eps=self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps  # (bs, n, hc)
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * self.scale[2] + comb_b.view(hc, hc), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):  # Sinkhorn-Knopp: rows, then columns, sum to 1
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return post, comb, (pre.unsqueeze(-1) * h).sum(dim=2).to(h.dtype)


class HyperHead(nn.Module):
    """The final collapse of the streams into one (transformers' ``DeepseekV4HyperHead``), before the last norm."""

    def __init__(self, args: DeepSeekV4Args):
        super().__init__()
        self.eps, self.norm_eps = args.hc_eps, args.norm_eps
        self.fn = nn.Parameter(torch.empty(args.hc_mult, args.hc_mult * args.dim))
        self.base = nn.Parameter(torch.empty(args.hc_mult))
        self.scale = nn.Parameter(torch.empty(1))

    def init_weights(self) -> None:
        trunc_normal_(self.fn, mean=0.0, std=0.02)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (bs, n, hc, dim) -> (bs, n, dim)."""
        flat = h.flatten(2).float()
        mixes = F.linear(F.rms_norm(flat, (flat.shape[-1],), eps=self.norm_eps), self.fn.float())  # (bs, n, hc)
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * h).sum(dim=2).to(h.dtype)
