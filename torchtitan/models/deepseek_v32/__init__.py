"""DeepSeek-V3.2 flavors ("deepseek_v32"): DeepSeek-V3 with DeepSeek Sparse Attention (DSA) in every layer.

debugmodel: deepseek_v3's debugmodel (dim 256, 6 layers, a q bottleneck of 128, YaRN, 8 experts in 2 groups) with a
lightning indexer of 4 heads of 32 picking 64 keys per query. debugmodel_tiny: the loss-parity tests' size (dim 64,
4 layers, 4 heads, q bottleneck 32, 4 experts; an indexer of 4 heads of 16 picking 16 keys, a quarter of the parity
runs' 64 tokens). 671B: DeepSeek-V3.2-Exp's
config.json (DeepSeek-V3's shapes, 64 indexer heads of 128, top 2048). Every flavor is the sparse stage: ``model.dsa_stage``
sets another (spec.py); the indexer's loss weight is ``indexer_loss_coeff`` (docs/models.md, "DeepSeek-V3.2").
"""

import dataclasses

from torchtitan.models.deepseek_v3 import deepseek_v3_configs
from torchtitan.models.deepseek_v32.args import DSA_STAGES, DeepSeekV32Args
from torchtitan.models.deepseek_v32.model import DeepSeekV32Transformer, DSAttention

__all__ = ["DSA_STAGES", "DSAttention", "DeepSeekV32Args", "DeepSeekV32Transformer", "deepseek_v32_configs"]


def _with_indexer(name: str, **fields) -> DeepSeekV32Args:
    """deepseek_v3's flavor ``name`` as DeepSeekV32Args, with ``fields`` (the indexer's shapes) on top."""
    flavor = deepseek_v3_configs[name]
    return DeepSeekV32Args(**{**{f.name: getattr(flavor, f.name) for f in dataclasses.fields(flavor)}, **fields})


deepseek_v32_configs = {
    "debugmodel": _with_indexer("debugmodel", index_n_heads=4, index_head_dim=32, index_topk=64),
    "debugmodel_tiny": _with_indexer(
        "debugmodel_tiny", q_lora_rank=32, index_n_heads=4, index_head_dim=16, index_topk=16
    ),
    # HF deepseek-ai/DeepSeek-V3.2-Exp config.json
    "671B": _with_indexer("671B", index_n_heads=64, index_head_dim=128, index_topk=2048),
}
