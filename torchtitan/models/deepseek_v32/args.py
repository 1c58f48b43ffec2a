"""``DeepSeekV32Args``: DeepSeek-V3's args (MLA, MoE, YaRN) plus DeepSeek Sparse Attention's lightning indexer.

Its own module, as deepseek_v3/args.py is: the model (model.py), the indexer (indexer.py) and the flavors import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.models.deepseek_v3.args import DeepSeekV3Args

DSA_STAGES = ("sparse", "dense_warmup")


@dataclass(frozen=True)
class DeepSeekV32Args(DeepSeekV3Args):
    """DeepSeekV3Args plus the lightning indexer (HF's ``index_n_heads``, ``index_head_dim``, ``index_topk``) and
    the training stage of DeepSeek-V3.2's recipe (docs/models.md, "DeepSeek-V3.2").

    ``dsa_stage``: "sparse" (each query attends to the ``index_topk`` keys its indexer scores highest; the model
    trains on the LM loss, the indexer on its KL loss over the selected keys, detached from the model) or
    "dense_warmup" (dense attention, every parameter but the indexers frozen, the indexer trained on its KL loss
    over every causal key). Inference (and HF parity) is the sparse stage's forward.
    """

    q_lora_rank: int = 1536  # the indexer's queries read the q bottleneck's normed latent: required here
    index_n_heads: int = 64
    index_head_dim: int = 128  # its first qk_rope_head_dim dims rotated by RoPE (halves, not pairs)
    index_topk: int = 2048  # keys each query attends to (all of them while fewer are causal)
    dsa_stage: str = "sparse"
    indexer_loss_coeff: float = 1.0  # the indexer's KL loss (summed over layers, mean over tokens) times this

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = (
            (self.q_lora_rank >= 1, "q_lora_rank", self.q_lora_rank, "the indexer reads the q latent: use >= 1"),
            (self.index_n_heads >= 1, "index_n_heads", self.index_n_heads, "use >= 1"),
            (
                self.index_head_dim >= self.qk_rope_head_dim,
                "index_head_dim",
                self.index_head_dim,
                f"RoPE rotates its first qk_rope_head_dim = {self.qk_rope_head_dim} dims: use at least that",
            ),
            (self.index_topk >= 1, "index_topk", self.index_topk, "use >= 1"),
            (self.dsa_stage in DSA_STAGES, "dsa_stage", self.dsa_stage, f"use one of {', '.join(DSA_STAGES)}"),
            (self.indexer_loss_coeff > 0, "indexer_loss_coeff", self.indexer_loss_coeff, "use a positive weight"),
        )
        for ok, key, value, fix in checks:
            if not ok:
                raise ValueError(f"DeepSeekV32Args.{key} = {value!r} is invalid: {fix}")
