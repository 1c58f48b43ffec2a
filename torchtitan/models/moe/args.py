"""``MoEArgs``: llama's ModelArgs plus the mixture-of-experts fields.

Its own module so that the MoE layer (moe.py) and the model (model.py) both import it and neither
imports the other's file for it: model.py -> moe.py -> args.py, one way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan.models.llama.model import ModelArgs, ffn_hidden_dim

_SCORE_FUNCS = ("softmax", "sigmoid")
_LOAD_BALANCE = ("aux_loss", "bias", "none")


@dataclass(frozen=True)
class MoEArgs(ModelArgs):
    """Llama's ModelArgs plus the MoE fields; ``dataclasses.replace`` keeps working on it."""

    num_experts: int = 8
    top_k: int = 2
    moe_hidden_dim: int = 256  # SwiGLU hidden size of each routed (and the shared) expert
    score_func: str = "softmax"  # "softmax" over experts, or an independent "sigmoid" per expert
    route_norm: bool = False  # rescale each token's top-k weights to sum to 1
    num_shared_experts: int = 0  # 0 or 1: an always-on expert of width moe_hidden_dim
    load_balance: str = "aux_loss"  # "aux_loss", "bias" (aux-loss-free, DeepSeek-V3) or "none"
    aux_loss_coeff: float = 0.01  # weight of the balance loss returned by aux_loss()
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
            (self.first_k_dense >= 0, "first_k_dense", self.first_k_dense, "use 0 or more"),
            (self.moe_every >= 1, "moe_every", self.moe_every, "use 1 (every layer) or more"),
        )
        for ok, key, value, fix in checks:
            if not ok:
                raise ValueError(f"MoEArgs.{key} = {value!r} is invalid: {fix}")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense and (layer_id - self.first_k_dense) % self.moe_every == 0

    def shared_expert_args(self) -> ModelArgs:
        """Args for which llama's FFN sizing rule (``ffn_hidden_dim``) gives exactly moe_hidden_dim."""
        base = int(2 * (4 * self.dim) / 3)
        # int(multiplier * base) lands on moe_hidden_dim or one below it; rounding up to a multiple
        # of moe_hidden_dim then gives moe_hidden_dim exactly.
        args = dataclasses.replace(self, ffn_dim_multiplier=self.moe_hidden_dim / base, multiple_of=self.moe_hidden_dim)
        assert ffn_hidden_dim(args) == self.moe_hidden_dim, (ffn_hidden_dim(args), self.moe_hidden_dim)
        return args
