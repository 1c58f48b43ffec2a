"""Llama 3 MoE ("llama3_moe") wired to the trainer: its ModelSpec, and what every MoE family shares:
the expert-parallel check, the active-parameter count (MFU's N), balanced routing under fake tensors,
the layer period and the load balancer's step hooks.

Not part of the pure model: this module may import ``torchtitan.spec`` and the config's errors.
``torchtitan.spec`` loads it on the first ``get_model_spec("llama3_moe")``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.models.llama.hf_adapter import ADAPTER as LLAMA_HF
from torchtitan.models.llama.spec import check_dense_config
from torchtitan.models.moe import MoETransformer, moe_configs, num_active_params
from torchtitan.spec import AdapterLayout, Deferred, ModelSpec

if TYPE_CHECKING:
    from torchtitan.config.schema import Experimental, Model, Training

# MoE load balancing (aux loss, expert bias, expert-load metrics) beside forward/backward.
BUILD_LOAD_BALANCER = Deferred("torchtitan.features.moe_balance.load_balancing:build_load_balancer")


def moe_flop_params(args: Any, model: nn.Module) -> int:
    return num_active_params(args, model)  # top_k of the routed experts


def balanced_routing(args: Any) -> Any:
    # Routing is data-dependent; under fake tensors every expert gets an equal share of the tokens.
    return dataclasses.replace(args, balanced_routing=True)


def moe_layer_pattern(args: Any) -> tuple[int, int]:
    return args.first_k_dense, args.moe_every


def llama3_moe_hf_refusal(args: Any) -> str:
    """Every llama3_moe flavor: its layers match no Hugging Face architecture (the converters refuse with this)."""
    return (
        "model.name = 'llama3_moe' has no Hugging Face counterpart: no transformers architecture has its layers "
        "(Llama's attention with routed experts beside an ungated shared expert, the first layer dense; Mixtral has "
        "no shared expert, Qwen2-MoE gates it, DeepSeek-V3 has its own attention); train model.name = 'qwen3_moe' "
        "(flavor debugmodel_aux_loss at the debug size) for a mixture of experts that exports"
    )


def expert_bias_hf_refusal(
    name: str, hf_class: str, flavors: Mapping[str, Any]
) -> Callable[[Mapping[str, Any]], str | None]:
    """A family whose Hugging Face class balances its experts with an aux loss: weights balanced with our expert
    bias have no counterpart there (the hf_refusal of qwen3_moe and qwen3_5_moe)."""
    aux_loss = [flavor_name for flavor_name, flavor in flavors.items() if flavor.load_balance == "aux_loss"]
    fix = ", ".join(aux_loss[:-1]) + f" or {aux_loss[-1]}" if len(aux_loss) > 1 else aux_loss[0]

    def refusal(args: Mapping[str, Any]) -> str | None:
        if args.get("load_balance") != "bias":
            return None
        return (
            f"{name} weights balanced with an expert bias (load_balance = 'bias') have no Hugging Face counterpart: "
            f"{hf_class}'s router has no bias, and folding it into the router is not exact (the bias only picks the "
            f"experts, their weights come from the unbiased scores); set model.flavor to one balanced by the aux "
            f"loss, as {hf_class} is: {fix}"
        )

    return refusal


def check_moe_config(args: Any, *, model: Model, training: Training, experimental: Experimental) -> list[str]:
    """Expert parallel and the MoE model (the EP/TP/dp_shard divisibility is checked by ParallelDims).

    Returns:
        warnings (none so far); raises ConfigError / NotImplementedError naming the key.
    """
    warnings = check_dense_config(args, model=model, training=training, experimental=experimental)
    exp, t = experimental, training
    ep, tp = exp.expert_parallel_degree, t.tensor_parallel_degree
    named = f"model.name = {model.name!r} (flavor {model.flavor!r})"
    if ep < 1:
        raise ConfigError(f"experimental.expert_parallel_degree must be >= 1, got {ep}")
    if not 1 <= args.top_k <= args.num_experts:
        raise ConfigError(f"{named}: top_k = {args.top_k} must be between 1 and num_experts = {args.num_experts}")
    if args.num_experts % ep:
        raise ConfigError(
            f"{named} has num_experts = {args.num_experts}, not divisible by "
            f"experimental.expert_parallel_degree = {ep}; choose an EP degree that divides it"
        )
    unsupported = [
        (
            tp > 1 and ep == 1,
            f"training.tensor_parallel_degree = {tp} with experimental.expert_parallel_degree = 1: "
            "the routed experts are not tensor-parallel; set expert_parallel_degree to a multiple of tp (EP contains "
            "the TP ranks)",
        ),
        (
            exp.context_parallel_degree > 1 and ep > 1,
            f"experimental.expert_parallel_degree = {ep} with "
            f"experimental.context_parallel_degree = {exp.context_parallel_degree}: expert parallel does not include "
            "CP ranks yet; set one of them to 1",
        ),
        (
            exp.enable_async_tensor_parallel,
            f"experimental.enable_async_tensor_parallel with {named}: the async TP "
            "plan has no MoE block; turn async TP off",
        ),
        (
            args.load_balance == "aux_loss" and exp.pipeline_parallel_degree > 1,
            f"{named} balances with an aux "
            f"loss, and under experimental.pipeline_parallel_degree = {exp.pipeline_parallel_degree} the middle "
            "stages cannot add to the loss; use a flavor with load_balance = 'bias' or pipeline_parallel_degree = 1",
        ),
    ]
    for bad, message in unsupported:
        if bad:
            raise NotImplementedError(message)
    return warnings


# What every MoE family built on these modules shares (qwen3_moe too).
MOE_WIRING: dict[str, Any] = {
    "documents": True,
    "count_flop_params": moe_flop_params,
    "build_step_hooks": BUILD_LOAD_BALANCER,
    "fake_tensor_args": balanced_routing,
    "check_fn": check_moe_config,
    "layer_pattern": moe_layer_pattern,
}

SPEC = ModelSpec(
    "llama3_moe",
    MoETransformer,
    moe_configs,
    **MOE_WIRING,
    hf_refusal=llama3_moe_hf_refusal,
    adapters=AdapterLayout(LLAMA_HF.block_names, ("feed_forward", "feed_forward.shared_expert")),
)
