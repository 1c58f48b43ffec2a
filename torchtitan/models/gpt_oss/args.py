"""``GptOssArgs``: the MoE args plus gpt-oss's own fields (head_dim, sliding window, sinks' RoPE, clamped SwiGLU).

Its own module so that the MoE layer (moe.py) and the model (model.py) both import it: model.py -> moe.py ->
args.py, one way.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.models.common.rope.yarn import YarnScaling
from torchtitan.models.moe.args import MoEArgs

LAYER_KINDS = ("sliding_attention", "full_attention")  # transformers' ``layer_types`` values


@dataclass(frozen=True)
class GptOssArgs(MoEArgs):
    """gpt-oss: every layer MoE (softmax over the top-k router logits, biased experts), GQA with biases and
    per-head sinks, sliding-window attention on alternating layers, YaRN RoPE."""

    head_dim: int = 64  # replaces ModelArgs.head_dim (a property there): 64 != dim / n_heads = 45 in 20B/120B
    rope_theta: float = 150000.0
    # None: plain RoPE. As published: no mscale (cos/sin times 0.1 * ln(factor) + 1), no truncation.
    yarn: YarnScaling | None = YarnScaling(factor=32.0, original_max_seq_len=4096, truncate=False)
    # Layer i attends within the last ``sliding_window`` tokens (itself included) unless
    # (i + 1) % full_attention_every == 0: gpt-oss's layer_types alternate sliding, full, sliding, ...
    sliding_window: int = 128
    full_attention_every: int = 2
    swiglu_alpha: float = 1.702  # the experts' gate: gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0  # gate clamped above, up clamped to [-limit, limit]
    first_k_dense: int = 0
    score_func: str = "softmax"
    route_norm: bool = True  # softmax over all experts, renormalised over the top-k = softmax over top-k logits
    num_shared_experts: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = (
            (self.first_k_dense == 0 and self.moe_every == 1, "first_k_dense", self.first_k_dense, "gpt-oss: all MoE"),
            (self.num_shared_experts == 0, "num_shared_experts", self.num_shared_experts, "gpt-oss has none; use 0"),
            (self.sliding_window >= 1, "sliding_window", self.sliding_window, "use a window of at least 1 token"),
            (self.full_attention_every >= 1, "full_attention_every", self.full_attention_every, "use 1 or more"),
            (self.n_heads % (self.n_kv_heads or self.n_heads) == 0, "n_kv_heads", self.n_kv_heads, "divide n_heads"),
        )
        for ok, key, value, fix in checks:
            if not ok:
                raise ValueError(f"GptOssArgs.{key} = {value!r} is invalid: {fix}")

    def layer_window(self, layer_id: int) -> int | None:
        """The layer's sliding window in tokens, or None where it attends to the whole (causal) context."""
        return None if (layer_id + 1) % self.full_attention_every == 0 else self.sliding_window

    def layer_types(self) -> list[str]:
        """transformers' ``layer_types`` for these args."""
        return [LAYER_KINDS[self.layer_window(i) is None] for i in range(self.n_layers)]


def aux_loss_coeff_from_hf(router_aux_loss_coef: float, top_k: int, n_layers: int) -> float:
    """Our per-layer aux-loss weight giving each layer's router the gradient transformers' loss gives it.

    transformers adds ``router_aux_loss_coef * E * sum_i F_i P_i`` (with ``output_router_logits``), F and P
    averaged over all layers and F counting top_k slots per token; ours sums per layer ``coeff * E * sum_i
    f_i P_i`` with f over the T * top_k slots. With every layer routing alike the gradients on a layer's
    router probabilities agree when coeff = coef * top_k / n_layers (0.15 for 20B, 0.1 for 120B).
    """
    return router_aux_loss_coef * top_k / n_layers


def aux_loss_coeff_to_hf(aux_loss_coeff: float, top_k: int, n_layers: int) -> float:
    """The inverse of ``aux_loss_coeff_from_hf``."""
    return aux_loss_coeff * n_layers / top_k
