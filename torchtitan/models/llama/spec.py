"""Llama 3 ("llama3") wired to the trainer: its ModelSpec and the dense families' own pre-launch check.

Not part of the pure model: this module may import ``torchtitan.spec`` and the config's errors.
``torchtitan.spec`` loads it on the first ``get_model_spec("llama3")``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchtitan.config.errors import ConfigError
from torchtitan.models.llama import Transformer, llama3_configs
from torchtitan.models.llama.hf_adapter import ADAPTER
from torchtitan.models.llama.model import ffn_hidden_dim
from torchtitan.spec import AdapterLayout, ModelSpec

if TYPE_CHECKING:
    from torchtitan.config.schema import Experimental, Model, Training


def check_dense_config(args: Any, *, model: Model, training: Training, experimental: Experimental) -> list[str]:
    """The FFN width under TP (llama's formula, or a family's ``ffn_dim``); no expert parallel without experts.

    Returns:
        warnings (the MoE aux-loss scope on a model without the switch aux loss); raises ConfigError naming the key.
    """
    tp, ep = training.tensor_parallel_degree, experimental.expert_parallel_degree
    hidden = getattr(args, "ffn_dim", None) or ffn_hidden_dim(args)
    if hidden % tp:
        raise ConfigError(
            f"model {model.flavor}: ffn hidden size = {hidden} is not divisible by "
            f"training.tensor_parallel_degree = {tp}; choose a TP degree that divides it"
        )
    if ep > 1 and not hasattr(args, "num_experts"):
        raise ConfigError(
            f"experimental.expert_parallel_degree = {ep} but model.name = {model.name!r} (flavor "
            f"{model.flavor!r}) has no experts; use an MoE family (llama3_moe) or set expert_parallel_degree = 1"
        )
    switch_aux = getattr(args, "load_balance", None) == "aux_loss" and not getattr(args, "aux_loss_per_sequence", False)
    if training.moe_aux_loss_scope != "global_micro_batch" and not switch_aux:
        return [
            f"training.moe_aux_loss_scope = {training.moe_aux_loss_scope!r} has no effect: model.name = "
            f"{model.name!r} (flavor {model.flavor!r}) has no switch aux loss (MoE load_balance = 'aux_loss')"
        ]
    return []


SPEC = ModelSpec(
    "llama3",
    Transformer,
    llama3_configs,
    documents=True,
    state_dict_adapter=ADAPTER,
    adapters=AdapterLayout(ADAPTER.block_names, ("feed_forward",), dense=True),
    check_fn=check_dense_config,
    hf_model_type="llama",
)
