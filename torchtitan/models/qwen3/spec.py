"""Qwen3 ("qwen3") and Qwen3-MoE ("qwen3_moe") wired to the trainer: their ModelSpecs.

Both reuse the lower families' wiring: llama's dense check, the MoE family's expert-parallel check,
active-parameter count, balanced routing, layer period and load balancer.
Not part of the pure model: this module may import ``torchtitan.spec``. ``torchtitan.spec`` loads it
on the first ``get_model_spec`` of either name.
"""

from __future__ import annotations

from torchtitan.models.llama.spec import check_dense_config
from torchtitan.models.moe.spec import (
    BUILD_LOAD_BALANCER,
    balanced_routing,
    check_moe_config,
    moe_flop_params,
    moe_layer_pattern,
)
from torchtitan.models.qwen3 import (
    Qwen3MoETransformer,
    Qwen3Transformer,
    hf_adapter,
    hf_moe_adapter,
    qwen3_configs,
    qwen3_moe_configs,
)
from torchtitan.spec import ModelSpec

SPECS = {
    "qwen3": ModelSpec(
        "qwen3",
        Qwen3Transformer,
        qwen3_configs,
        documents=True,
        state_dict_adapter=hf_adapter,
        check_fn=check_dense_config,
        hf_model_type="qwen3",
    ),
    "qwen3_moe": ModelSpec(
        "qwen3_moe",
        Qwen3MoETransformer,
        qwen3_moe_configs,
        documents=True,
        count_flop_params=moe_flop_params,
        build_step_hooks=BUILD_LOAD_BALANCER,
        fake_tensor_args=balanced_routing,
        state_dict_adapter=hf_moe_adapter,
        check_fn=check_moe_config,
        layer_pattern=moe_layer_pattern,
        hf_model_type="qwen3_moe",
    ),
}
