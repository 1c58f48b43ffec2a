"""Qwen3.5 ("qwen3_5") wired to the trainer: its ModelSpec and checks.

FSDP2, HSDP, DDP, activation checkpointing, compile and pipeline parallel take the family as llama's (the blocks keep
llama's names); tensor and context parallel are refused before launch (not built yet: Gated DeltaNet's fused q/k/v
projection and convolution are not sharded by heads, and its state is not passed along a context-parallel ring).
Not part of the pure model: this module may import ``torchtitan.spec``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchtitan.models.llama.spec import check_dense_config
from torchtitan.models.qwen3_5 import Qwen35Transformer, qwen3_5_configs
from torchtitan.models.qwen3_5.hf_adapter import QWEN3_5
from torchtitan.spec import AdapterLayout, ModelSpec

if TYPE_CHECKING:
    from torchtitan.config.schema import Experimental, Model, Training


def check_qwen3_5(args: Any, *, model: Model, training: Training, experimental: Experimental) -> list[str]:
    """What the family does not build yet, refused in one line each; then the dense checks."""
    for key, degree, why in (
        (
            "training.tensor_parallel_degree",
            training.tensor_parallel_degree,
            "Gated DeltaNet's fused q/k/v projection and convolution are not sharded by heads yet",
        ),
        (
            "experimental.context_parallel_degree",
            experimental.context_parallel_degree,
            "Gated DeltaNet's state and convolution history are not passed along the context-parallel ranks",
        ),
    ):
        if degree > 1:
            raise NotImplementedError(
                f"model.name = 'qwen3_5' with {key} = {degree}: not built ({why}); use FSDP, HSDP, DDP or pipeline "
                "parallel (docs/models.md)"
            )
    if training.compile and model.attn_mask_type == "block_causal":
        raise NotImplementedError(
            "model.name = 'qwen3_5' with training.compile and attn_mask_type = 'block_causal': not built (Gated "
            "DeltaNet restarts per document from lengths read on the host, which a compiled layer cannot); use one"
        )
    return check_dense_config(args, model=model, training=training, experimental=experimental)


SPEC = ModelSpec(
    "qwen3_5",
    Qwen35Transformer,
    qwen3_5_configs,
    documents=True,
    state_dict_adapter=QWEN3_5,
    adapters=AdapterLayout(QWEN3_5.block_names, ("feed_forward",), dense=True),
    check_fn=check_qwen3_5,
    hf_model_type="qwen3_5_text",
)
