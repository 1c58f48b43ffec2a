"""The mixture-of-experts layer: a token-choice top-k router, grouped SwiGLU experts, a shared expert.

Pure torch, like the rest of ``models/``. Expert parallel (distributed/expert_parallel/experts.py) wraps
``MoE.experts`` so that ``GroupedExperts.forward`` receives the tokens this rank's experts were sent,
already sorted by local expert; the layer itself never communicates.

Load balancing (``MoEArgs.load_balance``):
* ``"aux_loss"``: a switch-style balance loss per layer, kept in ``MoE.aux_loss`` (a tensor attached
  to the graph of the last forward). The trainer adds ``model.aux_loss()`` to its loss; nothing is
  injected into autograd behind its back, so the trainer controls the scale (gradient accumulation).
  Its statistics (slots per expert, summed probabilities) are this rank's tokens unless a ``StatsSum``
  is set (``set_stats_sum``): then they are summed over the ranks that hold the rest of the micro-batch,
  and the loss is that of the global micro-batch, the same whatever the layout (distributed/expert_parallel/moe_balance.py).
  With ``aux_loss_per_sequence`` it is DeepSeek's sequence-wise loss: one per batch row, averaged
  (the rows this rank holds: under sequence or context parallel, each rank's shard of a row).
* ``"bias"``: aux-loss-free balancing (DeepSeek-V3). A per-expert ``expert_bias`` buffer is added to
  the scores for *selection only*; after each optimizer step ``update_expert_bias`` nudges it
  against the (global) token counts. The combine weights never see the bias.
* ``"none"``: neither.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.init import trunc_normal_
from torchtitan.models.common.local import local_part
from torchtitan.models.llama.model import FeedForward
from torchtitan.models.moe.args import MoEArgs

# Sums a small statistics tensor over the ranks that hold the other tokens of this micro-batch, with the
# gradient an all-reduce would have (distributed/expert_parallel/moe_balance.py builds it; the model never communicates).
StatsSum = Callable[[torch.Tensor], torch.Tensor]


def compute_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """Router logits (T, E) -> scores: softmax over the experts, or per expert sigmoid or sqrt(softplus) (DeepSeek-V4)."""
    if score_func == "softmax":
        return logits.softmax(dim=-1)
    return logits.sigmoid() if score_func == "sigmoid" else F.softplus(logits).sqrt()


class TokenChoiceRouter(nn.Module):
    """Scores every expert for every token and picks each token's top-k experts.

    Args:
        num_groups, top_k_groups: group-limited routing (DeepSeek-V3; see MoEArgs.num_expert_groups);
            1 group: plain top-k.
        route_scale: the top-k weights are multiplied by it (after ``route_norm``).
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: str,
        route_norm: bool,
        *,
        num_groups: int = 1,
        top_k_groups: int = 1,
        route_scale: float = 1.0,
    ):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.num_groups, self.top_k_groups, self.route_scale = num_groups, top_k_groups, route_scale

    def init_weights(self) -> None:
        trunc_normal_(self.gate.weight, mean=0.0, std=0.02)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, dim) -> weights (T, top_k) fp32, experts (T, top_k) int64, scores (T, E) fp32.

        ``expert_bias`` (E,) shifts which experts are *selected*; the weights are the unbiased scores.
        """
        logits = self.gate(x).float()  # (T, E); fp32 so bf16 training still routes stably
        scores = compute_scores(logits, self.score_func)  # (T, E)
        choice = scores if expert_bias is None else scores + expert_bias
        if self.num_groups > 1:
            choice = self._limit_groups(choice)
        experts = choice.topk(self.top_k, dim=-1).indices  # (T, top_k)
        weights = scores.gather(-1, experts)  # (T, top_k)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return weights, experts, scores

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice (T, E) -> the same with -inf outside each token's top_k_groups groups.

        A group's score is the sum of its two best choice scores (transformers' DeepseekV3TopkRouter).
        """
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, self.num_groups, -1)  # (T, groups, E / groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (T, groups)
        top_groups = group_scores.topk(self.top_k_groups, dim=-1).indices  # (T, top_k_groups)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)  # (T, groups)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU FFNs with stacked weights, run over tokens grouped by expert."""

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True, balanced_routing: bool = False
    ):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.balanced_routing = balanced_routing  # read by expert parallel's dispatch (MoEArgs.balanced_routing)
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def init_weights(self, init_std: float) -> None:
        """As llama's FeedForward: w1 at std 0.02, w2/w3 at the block's depth-scaled std."""
        trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            trunc_normal_(w, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x (T, dim) sorted by expert; num_tokens_per_expert (E_local,) summing to T -> (T, dim).

        E_local is the number of experts whose weights this module holds locally (all of them
        without expert parallel).
        """
        w1, w2, w3 = local_part(self.w1), local_part(self.w2), local_part(self.w3)  # (E_local, ., .)
        if self.use_grouped_mm:
            return _grouped_swiglu(x, num_tokens_per_expert, w1, w2, w3)
        return _looped_swiglu(x, num_tokens_per_expert, w1, w2, w3)


def _grouped_swiglu(x, counts, w1, w2, w3) -> torch.Tensor:
    # offs: the end row of each expert's group. On CPU any group size works, empty ones included;
    # CUDA kernels want each group padded to a multiple of 16 rows (not done here).
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)  # (E_local,)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))  # (T, hidden)
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)  # (T, dim)


def _looped_swiglu(x, counts, w1, w2, w3) -> torch.Tensor:
    outs = []
    for e, x_e in enumerate(torch.split(x, counts.tolist())):  # x_e (T_e, dim)
        h = F.silu(x_e @ w1[e].transpose(0, 1)) * (x_e @ w3[e].transpose(0, 1))  # (T_e, hidden)
        outs.append(h @ w2[e].transpose(0, 1))  # (T_e, dim)
    return torch.cat(outs)  # (T, dim)


def compute_aux_loss(
    scores: torch.Tensor, num_tokens_per_expert: torch.Tensor, top_k: int, stats_sum: StatsSum | None = None
) -> torch.Tensor:
    """Switch-style balance loss E * sum_i f_i * P_i (1.0 when routing is perfectly balanced).

    f_i = the fraction of the T * top_k routing slots given to expert i (not differentiable);
    P_i = the mean over tokens of expert i's routing probability (the scores, row-normalised so
    sigmoid scores are probabilities too). scores (T, E); num_tokens_per_expert (E,).
    ``stats_sum``: T, f and P are those of every rank's tokens (the global micro-batch); None: this rank's.
    """
    num_tokens, num_experts = scores.shape
    probs = scores / scores.sum(dim=-1, keepdim=True)  # (T, E); a no-op for softmax
    if stats_sum is None:
        frac = num_tokens_per_expert.float() / max(num_tokens * top_k, 1)  # (E,)
        return num_experts * (frac * probs.mean(dim=0)).sum()
    # One (2, E) sum for both: the slots (detached: f carries no gradient) and the summed probabilities.
    stats = stats_sum(torch.stack([num_tokens_per_expert.float(), probs.sum(dim=0)]))  # (2, E), every rank alike
    slots = stats[0].detach()  # (E,) global routing slots per expert
    total_slots = slots.sum().clamp(min=1.0)  # global T * top_k
    return num_experts * top_k * (slots * stats[1]).sum() / (total_slots * total_slots)


def compute_sequence_aux_loss(scores: torch.Tensor, experts: torch.Tensor, top_k: int) -> torch.Tensor:
    """``compute_aux_loss`` of each sequence on its own, averaged over the sequences (DeepSeek's
    sequence-wise balance loss). scores (bs, seqlen, E); experts (bs, seqlen, top_k) the chosen ones."""
    bs, seqlen, num_experts = scores.shape
    slots = experts.reshape(bs, -1)  # (bs, seqlen * top_k)
    counts = torch.zeros(bs, num_experts, device=scores.device).scatter_add_(1, slots, torch.ones_like(slots).float())
    frac = counts / (seqlen * top_k)  # (bs, E)
    probs = scores / scores.sum(dim=-1, keepdim=True)  # (bs, seqlen, E)
    return num_experts * (frac * probs.mean(dim=1)).sum(dim=-1).mean()


class MoE(nn.Module):
    """Routed experts (+ an optional shared expert) replacing a block's feed-forward."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.load_balance, self.aux_loss_coeff = args.load_balance, args.aux_loss_coeff
        self.bias_update_rate = args.bias_update_rate
        self.aux_loss_per_sequence = args.aux_loss_per_sequence
        self.router = TokenChoiceRouter(
            args.dim,
            args.num_experts,
            args.top_k,
            args.score_func,
            args.route_norm,
            num_groups=args.num_expert_groups,
            top_k_groups=args.top_k_groups,
            route_scale=args.route_scale,
        )
        self.experts = GroupedExperts(
            args.dim, args.moe_hidden_dim, args.num_experts, args.use_grouped_mm, args.balanced_routing
        )
        shared_width = args.moe_hidden_dim * args.shared_expert_multiplier
        self.shared_expert: FeedForward | None = (
            FeedForward(args, hidden=shared_width) if args.num_shared_experts else None
        )
        gated = args.num_shared_experts and args.shared_expert_gate
        self.shared_expert_gate: nn.Linear | None = nn.Linear(args.dim, 1, bias=False) if gated else None
        if args.load_balance == "bias":
            # Model state (checkpointed), but not trained: only update_expert_bias changes it.
            self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        else:
            self.expert_bias = None
        # Tokens routed to each expert by the last forward on this rank; metrics and bias updates.
        # Assigned (not accumulated) each forward, so an activation-checkpoint recompute is harmless.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.stats_sum: StatsSum | None = None  # see set_stats_sum

    def set_stats_sum(self, stats_sum: StatsSum | None) -> None:
        """Compute the switch balance loss over the global micro-batch: ``stats_sum`` adds the other ranks'
        statistics (distributed/expert_parallel/moe_balance.py installs it); None: over this rank's tokens only."""
        self.stats_sum = stats_sum

    def init_weights(self, init_std: float) -> None:
        self.router.init_weights()
        self.experts.init_weights(init_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(init_std)
        if self.shared_expert_gate is not None:
            trunc_normal_(self.shared_expert_gate.weight, mean=0.0, std=0.02)
        with torch.no_grad():
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.tokens_per_expert.zero_()

    def route(self, x: torch.Tensor, tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, dim) -> weights (T, k), experts (T, k), scores (T, E); ``tokens`` (T,): the token ids, which a
        hash-routed layer (DeepSeek-V4's) picks its experts by; unused here."""
        return self.router(x, self.expert_bias)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """x (bs, seqlen, dim) -> (bs, seqlen, dim); tokens (bs, seqlen): the input ids, for ``route``."""
        bs, seqlen, dim = x.shape
        x = x.reshape(-1, dim)  # (T, dim)
        weights, experts, scores = self.route(
            x, None if tokens is None else tokens.reshape(-1)
        )  # (T, k), (T, k), (T, E)
        counts = self.count_tokens(experts)  # (E,)
        self.tokens_per_expert = counts.detach().float()
        if self.load_balance == "aux_loss" and torch.is_grad_enabled():  # only training backpropagates it
            aux_loss = self.aux_loss_coeff * (
                compute_sequence_aux_loss(scores.view(bs, seqlen, -1), experts.view(bs, seqlen, -1), self.top_k)
                if self.aux_loss_per_sequence
                else compute_aux_loss(scores, counts, self.top_k, self.stats_sum)
            )
            # Kept only from a forward the autograd engine is not running: activation checkpointing's recompute
            # (in backward; computed all the same, so it saves the tensors the first forward saved) would keep
            # the recomputed graph, attention scores included, alive until the next forward.
            if torch._C._current_graph_task_id() == -1:
                self.aux_loss = aux_loss

        out = self.routed_experts(x, weights, experts, counts)  # (T, dim)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out.view(bs, seqlen, dim)

    def routed_experts(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """x (T, dim) through each token's top-k experts (T, k), weighted (T, k) and summed -> (T, dim).

        The one part of the layer whose shapes depend on the routing (each expert's group of tokens), so a compiler
        may leave it to eager mode whole (distributed/parallelize.py ``apply_compile``).
        """
        # Permute the T * k routing slots so each expert's tokens are contiguous.
        order = torch.argsort(experts.flatten(), stable=True)  # (T*k,)
        token_of_slot = order // self.top_k  # (T*k,) the token each sorted slot came from
        routed = self.experts(x[token_of_slot], counts)  # (T*k, dim)
        routed = routed * weights.flatten()[order].unsqueeze(-1).to(routed.dtype)
        return torch.zeros_like(x).index_add(0, token_of_slot, routed)  # (T, dim): sum over the top-k

    def count_tokens(self, experts: torch.Tensor) -> torch.Tensor:
        """(T, top_k) chosen experts -> (E,) int64 routing slots per expert (balanced: see MoEArgs).

        A scatter-add, not ``bincount``: the same integers, and an output whose shape does not depend on the data.
        """
        if self.experts.balanced_routing:
            return torch.tensor(balanced_split(experts.numel(), self.num_experts), device=experts.device)
        slots = experts.flatten()  # (T*k,)
        return torch.zeros(self.num_experts, dtype=torch.int64, device=slots.device).scatter_add_(
            0, slots, torch.ones_like(slots)
        )

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """expert_bias += rate * sign(mean load - load): over-loaded experts get picked less.

        ``tokens_per_expert`` (E,) must be the *global* counts since the last update (all ranks,
        all microbatches), so every rank applies the same update.
        """
        if self.expert_bias is None or tokens_per_expert.sum() == 0:
            return
        load = tokens_per_expert.to(self.expert_bias)
        self.expert_bias.add_(self.bias_update_rate * torch.sign(load.mean() - load))


def balanced_split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` integers as even as possible (the larger ones first)."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)
