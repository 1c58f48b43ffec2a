"""Llama 3 with mixture-of-experts feed-forwards ("llama3_moe"). A plain nn.Module, like llama.

Attention, norms, embedding, output and the dense FFN are llama's own modules under llama's names,
so llama's TP plans for attention apply unchanged. A block's ``feed_forward`` is either llama's
FeedForward (dense layers) or an ``MoE`` (see moe.py). Load balancing is exposed to the trainer:
``aux_loss()`` (add it to the loss), ``expert_load()`` (metrics) and ``update_expert_bias()``
(call after each optimizer step, with counts reduced over the data-parallel ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan.models.llama.model import Attention, FeedForward, ModelArgs, Transformer, build_norm, ffn_hidden_dim
from torchtitan.models.moe.moe import MoE

_SCORE_FUNCS = ("softmax", "sigmoid")
_LOAD_BALANCE = ("aux_loss", "bias", "none")


@dataclass(frozen=True)
class MoEArgs(ModelArgs):
    """Llama's ModelArgs plus the MoE fields; ``dataclasses.replace`` keeps working on it."""

    num_experts: int = 8
    top_k: int = 2
    moe_hidden_dim: int = 256  # SwiGLU hidden size of each routed (and the shared) expert
    score_func: str = "softmax"  # "softmax" over experts, or an independent "sigmoid" per expert
    route_norm: bool = False  # rescale each token's top-k weights to sum to 1
    num_shared_experts: int = 0  # 0 or 1: an always-on expert of width moe_hidden_dim
    load_balance: str = "aux_loss"  # "aux_loss", "bias" (aux-loss-free, DeepSeek-V3) or "none"
    aux_loss_coeff: float = 0.01  # weight of the balance loss returned by aux_loss()
    bias_update_rate: float = 1e-3  # step of the sign update in update_expert_bias()
    first_k_dense: int = 1  # layers 0..first_k_dense-1 keep llama's dense FFN
    moe_every: int = 1  # after those, every moe_every-th layer is MoE (1: all, 2: interleaved)
    use_grouped_mm: bool = True  # torch._grouped_mm; False: a per-expert loop (same numbers)

    def __post_init__(self) -> None:
        checks = (
            (self.num_experts >= 1, "num_experts", self.num_experts, "use at least 1 expert"),
            (1 <= self.top_k <= self.num_experts, "top_k", self.top_k,
             f"each token picks top_k of num_experts = {self.num_experts}; set 1 <= top_k <= num_experts"),
            (self.moe_hidden_dim >= 1, "moe_hidden_dim", self.moe_hidden_dim, "use a positive width"),
            (self.score_func in _SCORE_FUNCS, "score_func", self.score_func, f"allowed are {_SCORE_FUNCS}"),
            (self.load_balance in _LOAD_BALANCE, "load_balance", self.load_balance, f"allowed are {_LOAD_BALANCE}"),
            (self.num_shared_experts in (0, 1), "num_shared_experts", self.num_shared_experts, "allowed are 0 and 1"),
            (self.first_k_dense >= 0, "first_k_dense", self.first_k_dense, "use 0 or more"),
            (self.moe_every >= 1, "moe_every", self.moe_every, "use 1 (every layer) or more"),
        )
        for ok, key, value, fix in checks:
            if not ok:
                raise ValueError(f"MoEArgs.{key} = {value!r} is invalid: {fix}")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense and (layer_id - self.first_k_dense) % self.moe_every == 0

    def shared_expert_args(self) -> ModelArgs:
        """Args for which llama's FFN sizing rule (``ffn_hidden_dim``) gives exactly moe_hidden_dim."""
        base = int(2 * (4 * self.dim) / 3)
        # int(multiplier * base) lands on moe_hidden_dim or one below it; rounding up to a multiple
        # of moe_hidden_dim then gives moe_hidden_dim exactly.
        args = dataclasses.replace(self, ffn_dim_multiplier=self.moe_hidden_dim / base, multiple_of=self.moe_hidden_dim)
        assert ffn_hidden_dim(args) == self.moe_hidden_dim, (ffn_hidden_dim(args), self.moe_hidden_dim)
        return args


class MoETransformerBlock(nn.Module):
    """Llama's block with ``feed_forward`` an MoE on MoE layers (llama's FeedForward elsewhere)."""

    def __init__(self, layer_id: int, args: MoEArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward: nn.Module = MoE(args) if args.is_moe_layer(layer_id) else FeedForward(args)
        self.attention_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.ffn_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)  # (bs, seqlen, dim)
        return h + self.feed_forward(self.ffn_norm(h))


class MoETransformer(Transformer):
    """Llama's Transformer (embedding, RoPE, norm, output, init units, forward) with MoE blocks."""

    def __init__(self, args: MoEArgs):
        # Llama's constructor with n_layers=0 builds everything but the blocks, which are ours.
        super().__init__(dataclasses.replace(args, n_layers=0))
        self.args = args
        self.layers = nn.ModuleDict({str(i): MoETransformerBlock(i, args) for i in range(args.n_layers)})

    def moe_layers(self) -> dict[str, MoE]:
        """Layer name ("1", "2", ...) -> its MoE, for the layers this module (or stage) owns.

        Looks inside each block, so wrappers (activation checkpointing, FSDP) do not hide them.
        """
        return {name: m for name, block in self.layers.items() for m in block.modules() if isinstance(m, MoE)}

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' weighted balance losses of the last forward (0 unless load_balance="aux_loss").

        Each layer's loss is computed on this rank's tokens. Add it to the training loss with the
        same scale as the cross-entropy (e.g. divided by the gradient-accumulation steps).
        """
        losses = [m.aux_loss for m in self.moe_layers().values() if m.aux_loss is not None]
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


def num_active_params(args: MoEArgs) -> int:
    """Parameters one token's forward multiplies by (the 6N in MFU): no embedding, top_k of the routed experts."""
    with torch.device("meta"):
        model = MoETransformer(args)
    total = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("tok_embeddings."))
    routed = sum(p.numel() for m in model.moe_layers().values() for p in m.experts.parameters())
    return total - routed * (args.num_experts - args.top_k) // args.num_experts
