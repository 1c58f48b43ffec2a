"""Qwen3 ("qwen3") and Qwen3-MoE ("qwen3_moe") wired to the trainer: their ModelSpecs.

Both reuse the lower families' wiring: llama's dense check, the MoE family's expert-parallel check,
active-parameter count, balanced routing, layer period and load balancer.
Not part of the pure model: this module may import ``torchtitan.spec``. ``torchtitan.spec`` loads it
on the first ``get_model_spec`` of either name.
"""

from __future__ import annotations

from torchtitan.models.llama.spec import check_dense_config
from torchtitan.models.moe.spec import MOE_WIRING, expert_bias_hf_refusal
from torchtitan.models.qwen3 import (
    Qwen3MoETransformer,
    Qwen3Transformer,
    qwen3_configs,
    qwen3_moe_configs,
)
from torchtitan.models.qwen3.hf_adapter import QWEN3, QWEN3_MOE
from torchtitan.spec import AdapterLayout, ModelSpec

qwen3_moe_hf_refusal = expert_bias_hf_refusal("qwen3_moe", "Qwen3-MoE", qwen3_moe_configs)


SPECS = {
    "qwen3": ModelSpec(
        "qwen3",
        Qwen3Transformer,
        qwen3_configs,
        documents=True,
        state_dict_adapter=QWEN3,
        adapters=AdapterLayout(QWEN3.block_names, ("feed_forward",), dense=True),
        check_fn=check_dense_config,
        hf_model_type="qwen3",
    ),
    "qwen3_moe": ModelSpec(
        "qwen3_moe",
        Qwen3MoETransformer,
        qwen3_moe_configs,
        **MOE_WIRING,
        state_dict_adapter=QWEN3_MOE,
        adapters=AdapterLayout(QWEN3_MOE.block_names, ()),
        hf_model_type="qwen3_moe",
        hf_refusal=qwen3_moe_hf_refusal,
    ),
}
