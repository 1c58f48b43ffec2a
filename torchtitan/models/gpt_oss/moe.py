"""gpt-oss's mixture of experts: our ``MoE`` with a biased router and clamped-SwiGLU experts with biases.

The layer is (a subclass of) llama3_moe's ``MoE``, so routing, the token permutation, load balancing
(``MoETransformer.moe_layers`` and the trainer's hooks) and expert parallel apply unchanged; the experts are
a ``GroupedExperts`` whose stacked (E, ., .) weights gain per-expert biases, (E, hidden) and (E, dim). Expert
parallel shards every parameter of the experts module over dim 0 (experts), the biases included.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.models.common.local import local_part
from torchtitan.models.gpt_oss.args import GptOssArgs
from torchtitan.models.moe.moe import GroupedExperts, MoE, TokenChoiceRouter


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation, as transformers' ``GptOssExperts._apply_gate``: (up + 1) * gate * sigmoid(alpha * gate),
    with gate clamped to <= limit and up to [-limit, limit] first. gate, up (T, hidden) -> (T, hidden)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


class GptOssExperts(GroupedExperts):
    """``num_experts`` clamped-SwiGLU FFNs with biases: w1/b1 the gate, w3/b3 the up projection, w2/b2 the down.

    transformers stores gate and up interleaved in one ``gate_up_proj`` (E, dim, 2 * hidden) (even columns
    gate, odd up); the adapter splits it into w1 and w3 (E, hidden, dim), llama3_moe's layout.
    """

    def __init__(self, args: GptOssArgs):
        super().__init__(args.dim, args.moe_hidden_dim, args.num_experts, args.use_grouped_mm, args.balanced_routing)
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit
        self.b1 = nn.Parameter(torch.empty(args.num_experts, args.moe_hidden_dim))
        self.b3 = nn.Parameter(torch.empty(args.num_experts, args.moe_hidden_dim))
        self.b2 = nn.Parameter(torch.empty(args.num_experts, args.dim))

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        for b in (self.b1, self.b2, self.b3):
            nn.init.zeros_(b)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x (T, dim) sorted by expert; num_tokens_per_expert (E_local,) summing to T -> (T, dim)."""
        w1, w2, w3 = local_part(self.w1), local_part(self.w2), local_part(self.w3)  # (E_local, ., .)
        b1, b2, b3 = local_part(self.b1), local_part(self.b2), local_part(self.b3)  # (E_local, .)
        # each row's expert, so row t gets its expert's biases; output_size: no host sync on the counts
        expert = torch.repeat_interleave(
            torch.arange(w1.shape[0], device=x.device), num_tokens_per_expert, output_size=x.shape[0]
        )  # (T,)
        if self.use_grouped_mm:
            offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)  # (E_local,) each group's end row
            gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs) + b1[expert]  # (T, hidden)
            up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs) + b3[expert]
            h = clamped_swiglu(gate, up, self.alpha, self.limit)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs) + b2[expert]  # (T, dim)
        outs = []
        for e, x_e in enumerate(torch.split(x, num_tokens_per_expert.tolist())):  # x_e (T_e, dim)
            gate, up = x_e @ w1[e].transpose(0, 1) + b1[e], x_e @ w3[e].transpose(0, 1) + b3[e]  # (T_e, hidden)
            outs.append(clamped_swiglu(gate, up, self.alpha, self.limit) @ w2[e].transpose(0, 1) + b2[e])
        return torch.cat(outs)  # (T, dim)


class GptOssRouter(TokenChoiceRouter):
    """llama3_moe's router with a biased gate. Softmax over all experts, the top-k picked and renormalised
    (``route_norm``) is softmax over the top-k logits, transformers' ``GptOssTopKRouter``."""

    def __init__(self, args: GptOssArgs):
        super().__init__(args.dim, args.num_experts, args.top_k, args.score_func, args.route_norm)
        self.gate = nn.Linear(args.dim, args.num_experts, bias=True)  # (E, dim) + (E,)

    def init_weights(self) -> None:
        super().init_weights()
        nn.init.zeros_(self.gate.bias)


class GptOssMoE(MoE):
    """Our ``MoE`` (routing, permutation, load balancing) with gpt-oss's router and experts."""

    def __init__(self, args: GptOssArgs):
        super().__init__(args)
        # MoE builds llama3_moe's unbiased router and experts; gpt-oss's replace them here, in its own
        # constructor (under the trainer's meta device the discarded ones never hold memory).
        self.router = GptOssRouter(args)
        self.experts = GptOssExperts(args)
