"""``DeepSeekV3Args`` (the MoE args plus multi-head latent attention, YaRN RoPE from models/common/rope/yarn.py).

Its own module, as models/moe/args.py is: the model (model.py) and the flavors import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torchtitan.models.common.rope.yarn import YarnScaling, yarn_mscale
from torchtitan.models.moe.args import MoEArgs


@dataclass(frozen=True)
class DeepSeekV3Args(MoEArgs):
    """MoEArgs (DeepSeek-V3's routing as defaults) plus multi-head latent attention (MLA).

    The MoE fields map to HF's: ``num_experts`` n_routed_experts, ``top_k`` num_experts_per_tok,
    ``moe_hidden_dim`` moe_intermediate_size, ``shared_expert_multiplier`` n_shared_experts,
    ``num_expert_groups`` / ``top_k_groups`` n_group / topk_group, ``route_norm`` norm_topk_prob,
    ``route_scale`` routed_scaling_factor, ``first_k_dense`` first_k_dense_replace, ``ffn_dim``
    the dense layers' intermediate_size; ``expert_bias`` is HF's e_score_correction_bias.
    """

    vocab_size: int = 129280
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None  # YaRN on the RoPE part of q and k; None: plain RoPE
    score_func: str = "sigmoid"
    route_norm: bool = True
    num_shared_experts: int = 1
    load_balance: str = "bias"
    ffn_dim: int = 18432  # SwiGLU width of the dense layers (0..first_k_dense-1)
    q_lora_rank: int = 0  # 0: q = wq(x); else q = wq_b(q_norm(wq_a(x))) through this rank
    kv_lora_rank: int = 512  # the compressed K/V latent per token (kv_norm, then wkv_b to every head)
    qk_nope_head_dim: int = 128  # per-head q/k dims without position
    qk_rope_head_dim: int = 64  # per-head q dims (and the one shared k) that RoPE rotates
    v_head_dim: int = 128
    # Multi-token prediction depths after the model (models/common/mtp.py; HF num_nextn_predict_layers); the
    # run's model.mtp_layers sets it (spec.py), no flavor does.
    mtp_layers: int = 0
    # The model class builds the depths (a family deriving these args without them says False: refused before launch).
    builds_mtp: ClassVar[bool] = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The mean of the q/k and the v head dims, for code that sizes attention by one head_dim.

        The attention FLOPs (12 * layers * heads * head_dim per (query, key) pair counts q.k and
        p.v at head_dim each) and a K/V block's bytes (heads * 2 * head_dim) are then exact.
        """
        return (self.qk_head_dim + self.v_head_dim) // 2

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = (
            (self.q_lora_rank >= 0, "q_lora_rank", self.q_lora_rank, "use 0 (no q compression) or a positive rank"),
            (self.kv_lora_rank >= 1, "kv_lora_rank", self.kv_lora_rank, "use a positive rank"),
            (
                self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2 == 0,
                "qk_rope_head_dim",
                self.qk_rope_head_dim,
                "RoPE rotates pairs: use an even size >= 2",
            ),
            (self.qk_nope_head_dim >= 0, "qk_nope_head_dim", self.qk_nope_head_dim, "use 0 or more"),
            (self.v_head_dim >= 1, "v_head_dim", self.v_head_dim, "use a positive size"),
            (self.mtp_layers >= 0, "mtp_layers", self.mtp_layers, "use 0 (no multi-token prediction) or more"),
            (
                self.n_kv_heads in (None, self.n_heads),
                "n_kv_heads",
                self.n_kv_heads,
                "MLA expands one K/V latent per token to every head; leave n_kv_heads unset",
            ),
        )
        for ok, key, value, fix in checks:
            if not ok:
                raise ValueError(f"DeepSeekV3Args.{key} = {value!r} is invalid: {fix}")


def softmax_scale_multiplier(yarn: YarnScaling | None) -> float:
    """MLA's softmax scale over qk_head_dim^-0.5: m(factor, mscale_all_dim)^2 under YaRN, else 1."""
    if yarn is None or not yarn.mscale_all_dim:
        return 1.0
    m = yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return m * m
