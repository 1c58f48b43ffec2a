"""Llama 3 with mixture-of-experts feed-forwards ("llama3_moe"). A plain nn.Module, like llama.

Attention, norms, embedding, output and the dense FFN are llama's own modules under llama's names,
so llama's TP plans for attention apply unchanged. A block's ``feed_forward`` is either llama's
FeedForward (dense layers) or an ``MoE`` (see moe.py). Load balancing is exposed to the trainer:
``aux_loss()`` (add it to the loss), ``expert_load()`` (metrics) and ``update_expert_bias()``
(call after each optimizer step, with counts reduced over the data-parallel ranks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchtitan.models.llama.model import Transformer, TransformerBlock
from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.moe.moe import MoE


def build_moe_block(layer_id: int, args: MoEArgs) -> TransformerBlock:
    """Llama's block with ``feed_forward`` an MoE on MoE layers (llama's FeedForward elsewhere)."""
    return TransformerBlock(layer_id, args, feed_forward=MoE(args) if args.is_moe_layer(layer_id) else None)


class MoETransformer(Transformer):
    """Llama's Transformer (embedding, RoPE, norm, output, init units, forward) with MoE blocks."""

    def __init__(self, args: MoEArgs, build_block: Callable[[int, MoEArgs], nn.Module] = build_moe_block):
        """``build_block``: llama's block with an MoE (default), or a family's variant of it (Qwen3-MoE)."""
        super().__init__(args, build_block=build_block)

    def moe_layers(self) -> dict[str, MoE]:
        """Layer name ("1", "2", ...) -> its MoE, for the layers this module (or stage) owns.

        Looks inside each block, so wrappers (activation checkpointing, FSDP) do not hide them.
        """
        return {name: m for name, block in self.layers.items() for m in block.modules() if isinstance(m, MoE)}

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' weighted balance losses of the last forward (0 unless load_balance="aux_loss"),
        taken from the layers (a second call before the next forward returns 0).

        Each layer's loss is computed on this rank's tokens, or on the global micro-batch where a layer has a
        stats sum (``MoE.set_stats_sum``). Add it to the training loss with the
        same scale as the cross-entropy (e.g. divided by the gradient-accumulation steps).
        """
        layers = self.moe_layers().values()
        losses = [m.aux_loss for m in layers if m.aux_loss is not None]
        for m in layers:  # taken: the layers no longer hold the forward's graph once the trainer has the loss
            m.aux_loss = None
        return torch.stack(losses).sum() if losses else torch.zeros((), device=self.rope_cache.device)

    def expert_load(self) -> dict[str, torch.Tensor]:
        """Layer name -> (num_experts,) tokens routed to each expert by the last forward, this rank only."""
        return {name: m.tokens_per_expert.clone() for name, m in self.moe_layers().items()}

    @torch.no_grad()
    def update_expert_bias(
        self,
        tokens_per_expert: dict[str, torch.Tensor] | None = None,
        reduce_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Update every MoE layer's expert_bias from token counts (load_balance="bias"; else a no-op).

        Args:
            tokens_per_expert: layer name -> counts since the last update (sum ``expert_load()``
                over the gradient-accumulation microbatches); default the last forward's.
            reduce_fn: maps the stacked (num_moe_layers, num_experts) local counts to the global
                ones, e.g. an all-reduce SUM over every rank that saw different tokens (dp and cp,
                not tp/pp). One call for all layers; the model itself never communicates.
        """
        layers = self.moe_layers()
        if not layers or all(m.expert_bias is None for m in layers.values()):
            return
        counts = tokens_per_expert if tokens_per_expert is not None else self.expert_load()
        stacked = torch.stack([counts[name].float() for name in layers])  # (num_moe_layers, E)
        if reduce_fn is not None:
            stacked = reduce_fn(stacked)
        for row, m in zip(stacked, layers.values()):
            m.update_expert_bias(row)


def num_active_params(args: MoEArgs, model: MoETransformer | None = None) -> int:
    """Parameters one token's forward multiplies by (the 6N in MFU): no embedding, top_k of the routed experts.

    ``model``: the (meta) model to count; default llama's MoE built from ``args``.
    """
    if model is None:
        with torch.device("meta"):
            model = MoETransformer(args)
    total = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("tok_embeddings."))
    routed = sum(p.numel() for m in model.moe_layers().values() for p in m.experts.parameters())
    return total - routed * (args.num_experts - args.top_k) // args.num_experts
