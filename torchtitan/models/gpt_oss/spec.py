"""gpt-oss ("gpt_oss") wired to the trainer: its ModelSpec and what cannot compose with it yet.

It reuses the MoE families' wiring (models/moe/spec.py): the expert-parallel check, active-parameter count,
balanced routing under fake tensors and the load balancer. Not part of the pure model: this module may
import ``torchtitan.spec``; ``torchtitan.spec`` loads it on the first ``get_model_spec("gpt_oss")``.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import lcm
from typing import TYPE_CHECKING, Any

from torchtitan.models.gpt_oss import GptOssTransformer, gpt_oss_configs
from torchtitan.models.gpt_oss.hf_adapter import ADAPTER
from torchtitan.models.moe.spec import MOE_WIRING, check_moe_config
from torchtitan.spec import ModelSpec

if TYPE_CHECKING:
    from torchtitan.config.schema import Experimental, Model, Training


def check_gpt_oss_config(args: Any, *, model: Model, training: Training, experimental: Experimental) -> list[str]:
    """The MoE checks, and torch's context parallel, which knows neither the attention sinks nor the window.

    Returns:
        warnings; raises ConfigError / NotImplementedError naming the key.
    """
    warnings = check_moe_config(args, model=model, training=training, experimental=experimental)
    cp = experimental.context_parallel_degree
    if cp > 1 and experimental.context_parallel_impl == "torch":
        raise NotImplementedError(
            f"experimental.context_parallel_degree = {cp} with context_parallel_impl = 'torch' and model.name = "
            "'gpt_oss': torch's ring attention has no attention sinks or sliding window; use context_parallel_impl = "
            "'portable' (our ring attention has both)"
        )
    if model.attention_backend != "auto":
        warnings.append(
            f"model.attention_backend = {model.attention_backend!r} has no effect on gpt_oss: its attention "
            "(sinks, sliding window) always runs its own masked-softmax kernel"
        )
    return warnings


def gpt_oss_layer_pattern(args: Any) -> tuple[int, int]:
    # every layer is MoE; the attention repeats sliding, ..., full every full_attention_every layers
    return 0, lcm(args.moe_every, args.full_attention_every)


def gpt_oss_hf_refusal(args: Mapping[str, Any]) -> str | None:
    """gpt-oss's router has a learned bias but no place for our selection-only expert bias."""
    if args.get("load_balance") != "bias":
        return None
    aux_loss = [name for name, flavor in gpt_oss_configs.items() if flavor.load_balance == "aux_loss"]
    return (
        "gpt_oss weights balanced with an expert bias (load_balance = 'bias') have no Hugging Face counterpart: "
        "the bias only picks the experts (their weights come from the unbiased scores), which GptOss's router "
        f"bias cannot reproduce; set model.flavor to one balanced by the aux loss: {', '.join(aux_loss)}"
    )


SPEC = ModelSpec(
    "gpt_oss",
    GptOssTransformer,
    gpt_oss_configs,
    **{**MOE_WIRING, "check_fn": check_gpt_oss_config, "layer_pattern": gpt_oss_layer_pattern},
    state_dict_adapter=ADAPTER,
    hf_model_type="gpt_oss",
    hf_refusal=gpt_oss_hf_refusal,
)
