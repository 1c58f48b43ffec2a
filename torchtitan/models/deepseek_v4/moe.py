"""DeepSeek-V4's mixture of experts: our ``MoE`` with clamped-SwiGLU experts and shared expert, sqrt(softplus)
scores, and on ``hash_moe`` layers experts picked by a fixed table of the token id (``tid2eid``) instead of top-k.

Routing, the token permutation, load balancing and expert parallel are llama3_moe's (models/moe/moe.py); the
experts are a ``GroupedExperts`` (w1 gate, w3 up, w2 down), so expert parallel shards them unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan.models.common.local import local_part
from torchtitan.models.deepseek_v4.args import DeepSeekV4Args
from torchtitan.models.llama.model import FeedForward
from torchtitan.models.moe.moe import GroupedExperts, MoE, compute_scores


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate clamped to <= limit) * (up clamped to [-limit, limit]), transformers' DeepseekV4 ``_apply_gate``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class ClampedExperts(GroupedExperts):
    """``num_experts`` clamped-SwiGLU FFNs with stacked weights (transformers' ``gate_up_proj`` is w1 and w3
    stacked, ``down_proj`` is w2)."""

    def __init__(self, args: DeepSeekV4Args):
        super().__init__(args.dim, args.moe_hidden_dim, args.num_experts, args.use_grouped_mm, args.balanced_routing)
        self.limit = args.swiglu_limit

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x (T, dim) sorted by expert; num_tokens_per_expert (E_local,) summing to T -> (T, dim)."""
        w1, w2, w3 = local_part(self.w1), local_part(self.w2), local_part(self.w3)  # (E_local, ., .)
        if self.use_grouped_mm:
            offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)  # (E_local,) each group's end row
            gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)  # (T, hidden)
            h = clamped_swiglu(gate, torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs), self.limit)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)  # (T, dim)
        outs = []
        for e, x_e in enumerate(torch.split(x, num_tokens_per_expert.tolist())):  # x_e (T_e, dim)
            h = clamped_swiglu(x_e @ w1[e].transpose(0, 1), x_e @ w3[e].transpose(0, 1), self.limit)
            outs.append(h @ w2[e].transpose(0, 1))
        return torch.cat(outs)  # (T, dim)


class ClampedFeedForward(FeedForward):
    """The shared expert: llama's FeedForward with V4's clamps."""

    def __init__(self, args: DeepSeekV4Args):
        super().__init__(args, hidden=args.moe_hidden_dim)
        self.limit = args.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class V4MoE(MoE):
    """Our ``MoE`` with V4's experts and shared expert; ``hashed``: a hash_moe layer (no expert bias: the table
    picks the experts, the gate's scores only weight them)."""

    def __init__(self, args: DeepSeekV4Args, hashed: bool):
        super().__init__(args)
        self.experts = ClampedExperts(args)
        self.shared_expert = ClampedFeedForward(args)
        self.hashed = hashed
        if hashed:
            self.expert_bias = None
            # token id -> its top_k experts: model state (checkpointed), never trained
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, args.top_k, dtype=torch.long))

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        if self.hashed:  # top_k distinct experts per token, drawn from the global RNG (transformers: zeros)
            with torch.no_grad():
                draws = torch.rand(self.tid2eid.shape[0], self.num_experts, device=self.tid2eid.device)
                self.tid2eid.copy_(draws.topk(self.top_k, dim=-1).indices)

    def route(self, x: torch.Tensor, tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.hashed:
            return self.router(x, self.expert_bias)
        if tokens is None:
            raise ValueError("a hash_moe layer routes by token id: call the model on token ids, not embeddings")
        scores = compute_scores(self.router.gate(x).float(), self.router.score_func)  # (T, E)
        experts = self.tid2eid[tokens]  # (T, top_k)
        weights = scores.gather(-1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.router.route_scale
        return weights, experts, scores
