"""``DeepSeekV4Args``: the MoE args plus DeepSeek-V4's attention (sliding, compressed-sparse, heavily-compressed),
hyper-connections and hash routing. Its own module, as models/moe/args.py is: model.py and the flavors import it.

The names of the kinds are transformers' (``DeepseekV4Config.layer_types`` / ``mlp_layer_types``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.models.common.rope.yarn import YarnScaling
from torchtitan.models.moe.args import MoEArgs

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTENTION_KINDS = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
MLP_KINDS = (HASH_MOE, MOE)


@dataclass(frozen=True)
class DeepSeekV4Args(MoEArgs):
    """MoEArgs (V4's routing as defaults: sqrt(softplus) scores, normalised, times 1.5, one shared expert, the
    expert bias) plus V4's fields. The MoE fields map to HF's as DeepSeek-V3's do (``num_experts`` n_routed_experts,
    ``moe_hidden_dim`` moe_intermediate_size, the shared expert's width too, ``route_scale``
    routed_scaling_factor, ``expert_bias`` e_score_correction_bias).
    """

    vocab_size: int = 129280
    norm_eps: float = 1e-6
    n_kv_heads: int | None = 1  # shared-KV multi-query attention: one head, read as both key and value
    head_dim: int = 512  # replaces ModelArgs.head_dim (a property there)
    rope_dim: int = 64  # the trailing dims of each head RoPE rotates (qk_rope_head_dim)
    q_lora_rank: int = 1024
    rope_theta: float = 10000.0  # sliding layers' RoPE
    compress_rope_theta: float = 160000.0  # compressed layers' and their compressors' RoPE
    compress_yarn: YarnScaling | None = None  # YaRN on the compressed layers' RoPE only; None: plain
    layer_types: tuple[str, ...] = ()  # one of ATTENTION_KINDS per layer
    mlp_layer_types: tuple[str, ...] = ()  # one of MLP_KINDS per layer
    csa_rate: int = 4  # compressed-sparse attention: one compressed entry per csa_rate tokens (windows overlap 2x)
    hca_rate: int = 128  # heavily-compressed attention: one entry per hca_rate tokens
    sliding_window: int = 128  # every layer attends to the last sliding_window tokens, itself included
    hc_mult: int = 4  # residual streams of the manifold-constrained hyper-connections
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0  # experts and shared expert: gate clamped above, up to [-limit, limit]
    o_groups: int = 8  # grouped low-rank output projection: head groups ...
    o_lora_rank: int = 1024  # ... each projected to this width before the shared output linear
    index_n_heads: int = 64  # the lightning indexer (compressed-sparse layers)
    index_head_dim: int = 128
    index_topk: int = 512  # compressed entries each query keeps
    score_func: str = "sqrtsoftplus"
    route_norm: bool = True
    route_scale: float = 1.5
    num_shared_experts: int = 1
    load_balance: str = "bias"
    first_k_dense: int = 0  # every layer is MoE (hash-routed or top-k)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, kinds, allowed in (
            ("layer_types", self.layer_types, ATTENTION_KINDS),
            ("mlp_layer_types", self.mlp_layer_types, MLP_KINDS),
        ):
            if len(kinds) != self.n_layers:
                raise ValueError(
                    f"DeepSeekV4Args.{key} has {len(kinds)} entries for n_layers = {self.n_layers}: give one per layer"
                )
            bad = [(i, k) for i, k in enumerate(kinds) if k not in allowed]
            if bad:
                raise ValueError(
                    f"DeepSeekV4Args.{key}[{bad[0][0]}] = {bad[0][1]!r} is unknown; allowed are {allowed}: fix the "
                    "layer's kind"
                )
        for ok, key, value, fix in self._checks():
            if not ok:
                raise ValueError(f"DeepSeekV4Args.{key} = {value!r} is invalid: {fix}")

    def _checks(self) -> tuple[tuple[bool, str, object, str], ...]:
        width = self.n_heads * self.head_dim
        return (
            (self.n_kv_heads == 1, "n_kv_heads", self.n_kv_heads, "V4 attention has one shared key/value head; use 1"),
            (
                self.rope_dim % 2 == 0 and 2 <= self.rope_dim <= min(self.head_dim, self.index_head_dim),
                "rope_dim",
                self.rope_dim,
                f"RoPE rotates pairs of the trailing dims: use an even size <= head_dim ({self.head_dim}) and "
                f"index_head_dim ({self.index_head_dim})",
            ),
            (self.q_lora_rank >= 1, "q_lora_rank", self.q_lora_rank, "use a positive rank"),
            (self.csa_rate >= 1, "csa_rate", self.csa_rate, "use 1 or more tokens per compressed entry"),
            (self.hca_rate >= 1, "hca_rate", self.hca_rate, "use 1 or more tokens per compressed entry"),
            (self.sliding_window >= 1, "sliding_window", self.sliding_window, "use a window of at least 1 token"),
            (self.hc_mult >= 1, "hc_mult", self.hc_mult, "use 1 or more residual streams"),
            (self.hc_sinkhorn_iters >= 1, "hc_sinkhorn_iters", self.hc_sinkhorn_iters, "use 1 or more"),
            (
                self.o_groups >= 1 and width % self.o_groups == 0,
                "o_groups",
                self.o_groups,
                f"use a divisor of n_heads * head_dim = {width} (the heads' outputs split into equal groups)",
            ),
            (self.o_lora_rank >= 1, "o_lora_rank", self.o_lora_rank, "use a positive rank"),
            (self.index_topk >= 1, "index_topk", self.index_topk, "use 1 or more"),
            (self.index_n_heads >= 1, "index_n_heads", self.index_n_heads, "use 1 or more"),
            (self.num_shared_experts == 1, "num_shared_experts", self.num_shared_experts, "V4 has one; use 1"),
            (self.first_k_dense == 0 and self.moe_every == 1, "first_k_dense", self.first_k_dense, "V4: all MoE, 0"),
        )

    def layer_rate(self, layer_id: int) -> int:
        """The layer's compress rate (tokens per compressed entry); 0 on a sliding-only layer."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_types[layer_id]]


def default_layer_types(n_layers: int) -> tuple[str, ...]:
    """transformers' default schedule: two heavily-compressed layers, then compressed-sparse and heavily-compressed
    alternating."""
    rest = [CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0))]
    return tuple(([HCA] * min(n_layers, 2) + rest)[:n_layers])


def default_mlp_layer_types(n_layers: int, num_hash_layers: int = 3) -> tuple[str, ...]:
    """transformers' default: the first ``num_hash_layers`` layers hash-routed, the rest top-k."""
    return tuple([HASH_MOE] * min(n_layers, num_hash_layers) + [MOE] * max(0, n_layers - num_hash_layers))
