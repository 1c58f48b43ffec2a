"""Qwen3 ("qwen3") and Qwen3-MoE ("qwen3_moe") wired to the trainer: their ModelSpecs.

Both reuse the lower families' wiring: llama's dense check, the MoE family's expert-parallel check,
active-parameter count, balanced routing, layer period and load balancer.
Not part of the pure model: this module may import ``torchtitan.spec``. ``torchtitan.spec`` loads it
on the first ``get_model_spec`` of either name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan.models.llama.spec import check_dense_config
from torchtitan.models.moe.spec import MOE_WIRING
from torchtitan.models.qwen3 import (
    Qwen3MoETransformer,
    Qwen3Transformer,
    qwen3_configs,
    qwen3_moe_configs,
)
from torchtitan.models.qwen3.hf_adapter import QWEN3, QWEN3_MOE
from torchtitan.spec import AdapterLayout, ModelSpec


def qwen3_moe_hf_refusal(args: Mapping[str, Any]) -> str | None:
    """Qwen3-MoE balances its experts with an aux loss; HF's router has no place for our expert bias."""
    if args.get("load_balance") != "bias":
        return None
    aux_loss = [name for name, flavor in qwen3_moe_configs.items() if flavor.load_balance == "aux_loss"]
    return (
        "qwen3_moe weights balanced with an expert bias (load_balance = 'bias') have no Hugging Face counterpart: "
        "Qwen3-MoE's router has no bias, and folding it into the router is not exact (the bias only picks the "
        "experts, their weights come from the unbiased scores); set model.flavor to one balanced by the aux loss, "
        f"as Qwen3-MoE is: {', '.join(aux_loss[:-1])} or {aux_loss[-1]}"
    )


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
