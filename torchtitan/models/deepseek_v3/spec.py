"""DeepSeek-V3 ("deepseek_v3") wired to the trainer: its ModelSpec, its pre-launch check and HF refusal.

It reuses the MoE families' wiring (expert-parallel check, active-parameter count, balanced routing
under fake tensors, layer period, load balancer). Not part of the pure model: this module may import
``torchtitan.spec`` and the config's errors. ``torchtitan.spec`` loads it on the first
``get_model_spec("deepseek_v3")``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchtitan.models.deepseek_v3 import DeepSeekV3Transformer, deepseek_v3_configs
from torchtitan.models.deepseek_v3.hf_adapter import ADAPTER
from torchtitan.models.moe.spec import MOE_WIRING, check_moe_config
from torchtitan.spec import AdapterLayout, ModelSpec

if TYPE_CHECKING:
    from torchtitan.config.schema import Experimental, Model, Training


def check_deepseek_v3_config(args: Any, *, model: Model, training: Training, experimental: Experimental) -> list[str]:
    """What the parallelisms cannot do with MLA yet, then the MoE check (EP, TP, compile, PP with aux loss).

    Returns:
        warnings (none so far); raises NotImplementedError / ConfigError naming the key.
    """
    named = f"model.name = {model.name!r} (flavor {model.flavor!r})"
    cp = experimental.context_parallel_degree
    if cp > 1 and experimental.context_parallel_impl == "torch" and args.v_head_dim != args.qk_head_dim:
        raise NotImplementedError(
            f"experimental.context_parallel_degree = {cp} with context_parallel_impl = 'torch' and {named}: torch's "
            f"ring attention needs v heads as wide as q/k heads, and MLA's are {args.v_head_dim} vs "
            f"{args.qk_head_dim}; use context_parallel_impl = 'portable' (our ring attention)"
        )
    return check_moe_config(args, model=model, training=training, experimental=experimental)


def deepseek_v3_hf_refusal(args: Mapping[str, Any]) -> str | None:
    """Weights whose layers ``DeepseekV3ForCausalLM`` does not compute (None where they export exactly)."""
    why = []
    if args.get("score_func", "sigmoid") != "sigmoid":
        why.append(
            f"score_func = {args['score_func']!r} (DeepSeek-V2-Lite's softmax routing is transformers' "
            "DeepseekV2; DeepseekV3 routes with sigmoid scores)"
        )
    if args.get("moe_every", 1) != 1:
        why.append(f"moe_every = {args['moe_every']} (DeepseekV3 has every layer from first_k_dense_replace MoE)")
    if args.get("norm_type", "rmsnorm") not in ("rmsnorm", "fused_rmsnorm"):
        why.append(f"model.norm_type = {args['norm_type']!r} (DeepseekV3 uses RMSNorm)")
    if not why:
        return None
    exports = [name for name, flavor in deepseek_v3_configs.items() if flavor.score_func == "sigmoid"]
    return (
        f"deepseek_v3 weights with {'; '.join(why)} have no Hugging Face DeepseekV3ForCausalLM counterpart; "
        f"train a flavor that exports ({', '.join(exports)}) with model.norm_type = 'rmsnorm'"
    )


def with_mtp(args: Any, model: Model) -> Any:
    """The flavor's args with the run's multi-token-prediction depths (``model.mtp_layers``)."""
    return args if model.mtp_layers == args.mtp_layers else dataclasses.replace(args, mtp_layers=model.mtp_layers)


SPEC = ModelSpec(
    "deepseek_v3",
    DeepSeekV3Transformer,
    deepseek_v3_configs,
    **{**MOE_WIRING, "check_fn": check_deepseek_v3_config},
    state_dict_adapter=ADAPTER,
    adapters=AdapterLayout(ADAPTER.block_names, ("feed_forward", "feed_forward.shared_expert"), peft_ffn_remapped=True),
    hf_model_type="deepseek_v3",
    hf_refusal=deepseek_v3_hf_refusal,
    configure=with_mtp,
)
