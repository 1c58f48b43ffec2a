"""``MoEArgs``: llama's ModelArgs plus the mixture-of-experts fields.

Its own module so that the MoE layer (moe.py) and the model (model.py) both import it and neither
imports the other's file for it: model.py -> moe.py -> args.py, one way.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.models.llama.model import ModelArgs

_SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
_LOAD_BALANCE = ("aux_loss", "bias", "none")


@dataclass(frozen=True)
class MoEArgs(ModelArgs):
    """Llama's ModelArgs plus the MoE fields; ``dataclasses.replace`` keeps working on it."""

    num_experts: int = 8
    top_k: int = 2
    moe_hidden_dim: int = 256  # SwiGLU hidden size of each routed (and the shared) expert
    score_func: str = (
        "softmax"  # "softmax" over experts, or an independent "sigmoid" / "sqrtsoftplus" (DeepSeek-V4) per expert
    )
    route_norm: bool = False  # rescale each token's top-k weights to sum to 1
    route_scale: float = 1.0  # the routed experts' weights times this (DeepSeek-V3's routed_scaling_factor)
    # Group-limited routing (DeepSeek-V3's n_group / topk_group): the experts form num_expert_groups
    # equal groups, a group scores the sum of its two best (biased) scores, and each token picks its
    # top_k experts among those of its top_k_groups best groups. 1 group: plain top-k.
    num_expert_groups: int = 1
    top_k_groups: int = 1
    num_shared_experts: int = 0  # 0 or 1: an always-on expert of width moe_hidden_dim * shared_expert_multiplier
    # The shared expert's width in units of moe_hidden_dim: DeepSeek's n_shared_experts, which are
    # one SwiGLU that many times wider (the same function as that many experts summed).
    shared_expert_multiplier: int = 1
    # Scale the shared expert's output by sigmoid(a learned linear of the token) (Qwen2-MoE's and Qwen3.5-MoE's
    # ``shared_expert_gate``); False: added as it is (DeepSeek-V3).
    shared_expert_gate: bool = False
    load_balance: str = "aux_loss"  # "aux_loss", "bias" (aux-loss-free, DeepSeek-V3) or "none"
    aux_loss_coeff: float = 0.01  # weight of the balance loss returned by aux_loss()
    # load_balance="aux_loss": the balance loss of each sequence (batch row), averaged over the rows
    # (DeepSeek's sequence-wise loss), instead of one loss over all the layer's tokens.
    aux_loss_per_sequence: bool = False
    bias_update_rate: float = 1e-3  # step of the sign update in update_expert_bias()
    first_k_dense: int = 1  # layers 0..first_k_dense-1 keep llama's dense FFN
    moe_every: int = 1  # after those, every moe_every-th layer is MoE (1: all, 2: interleaved)
    use_grouped_mm: bool = True  # torch._grouped_mm; False: a per-expert loop (same numbers)
    # Count every expert as receiving an equal share of the routing slots instead of the router's
    # choice (the memory estimator's assumption: real routing is data-dependent and cannot run on
    # fake tensors). Tokens still go through the router; only the counts, and so the group sizes
    # and expert-parallel splits, are the balanced ones. Never set for training.
    balanced_routing: bool = False

    def __post_init__(self) -> None:
        checks = (
            (self.num_experts >= 1, "num_experts", self.num_experts, "use at least 1 expert"),
            (
                1 <= self.top_k <= self.num_experts,
                "top_k",
                self.top_k,
                f"each token picks top_k of num_experts = {self.num_experts}; set 1 <= top_k <= num_experts",
            ),
            (self.moe_hidden_dim >= 1, "moe_hidden_dim", self.moe_hidden_dim, "use a positive width"),
            (self.score_func in _SCORE_FUNCS, "score_func", self.score_func, f"allowed are {_SCORE_FUNCS}"),
            (self.load_balance in _LOAD_BALANCE, "load_balance", self.load_balance, f"allowed are {_LOAD_BALANCE}"),
            (self.num_shared_experts in (0, 1), "num_shared_experts", self.num_shared_experts, "allowed are 0 and 1"),
            (
                self.shared_expert_multiplier >= 1,
                "shared_expert_multiplier",
                self.shared_expert_multiplier,
                "use 1 or more (the shared expert's width in units of moe_hidden_dim)",
            ),
            (self.route_scale > 0, "route_scale", self.route_scale, "use a positive scale (1.0: none)"),
            *self._group_checks(),
            (self.first_k_dense >= 0, "first_k_dense", self.first_k_dense, "use 0 or more"),
            (self.moe_every >= 1, "moe_every", self.moe_every, "use 1 (every layer) or more"),
        )
        for ok, key, value, fix in checks:
            if not ok:
                raise ValueError(f"MoEArgs.{key} = {value!r} is invalid: {fix}")

    def _group_checks(self) -> tuple[tuple[bool, str, object, str], ...]:
        groups, per_group = self.num_expert_groups, self.num_experts // max(self.num_expert_groups, 1)
        return (
            (
                groups >= 1 and self.num_experts % groups == 0,
                "num_expert_groups",
                groups,
                f"use a divisor of num_experts = {self.num_experts} (1: no groups)",
            ),
            (
                groups == 1 or per_group >= 2,
                "num_expert_groups",
                groups,
                "each group needs 2 or more experts (a group scores the sum of its two best); use fewer groups",
            ),
            (
                1 <= self.top_k_groups <= groups and self.top_k <= self.top_k_groups * per_group,
                "top_k_groups",
                self.top_k_groups,
                f"set 1 <= top_k_groups <= num_expert_groups = {groups}, with top_k = {self.top_k} <= "
                f"top_k_groups * {per_group} experts per group",
            ),
        )

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense and (layer_id - self.first_k_dense) % self.moe_every == 0
