"""Multi-token prediction (MTP), as the DeepSeek-V3 report describes it: ``D`` sequential depths after the model.

Depth k (1..D) predicts token i+k+1 at position i. Its input is the previous depth's hidden state ``h^{k-1}``
(depth 1: the model's final-normed hidden state, the one its output head reads) and the embedding of token i+k,
each RMS-normed (``hnorm``, ``enorm``), concatenated [embedding, hidden] and projected back to ``dim``
(``eh_proj``); one transformer block of the family (MoE where the family's layers are) gives ``h^k``, and the
shared output head reads ``norm(h^k)`` (``norm`` is the published ``shared_head.norm``). The embedding table and
the output head are the model's own (shared, as in the report), never copies.

The sequence keeps its length: depth k's embedding input is the tokens rolled left by k, so its last k
positions read wrapped tokens; causal attention keeps them from every earlier position, and their labels are
ignored (``mtp_labels``). Pure math: no parallelism here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator

import torch
from torch import nn

from torchtitan.models.common.documents import IGNORE_INDEX
from torchtitan.models.common.init import trunc_normal_


def builds_mtp(args: object) -> bool:
    """Whether a model of these args builds the depths: args with ``mtp_layers`` that say ``builds_mtp``."""
    return hasattr(args, "mtp_layers") and getattr(args, "builds_mtp", False)


class MTPDepth(nn.Module):
    """One MTP depth: ``enorm``, ``hnorm``, ``eh_proj`` (2 dim -> dim), ``block``, ``norm`` (before the shared head)."""

    def __init__(self, dim: int, block: nn.Module, build_norm: Callable[[], nn.Module]):
        super().__init__()
        self.enorm = build_norm()
        self.hnorm = build_norm()
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = build_norm()

    def init_weights(self) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        trunc_normal_(self.eh_proj.weight, mean=0.0, std=0.02)
        self.block.init_weights()

    def forward(
        self, h: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """h (bs, seqlen, dim): the previous depth's hidden state; embedded (bs, seqlen, dim): the embedding of
        the token k ahead -> this depth's hidden state (bs, seqlen, dim), before ``norm``."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))  # (bs, seqlen, dim)
        return self.block(x, rope) if doc_ids is None else self.block(x, rope, doc_ids=doc_ids)


def build_mtp(
    num_depths: int, dim: int, first_layer_id: int, build_block: Callable[[int], nn.Module], build_norm: Callable
) -> nn.ModuleDict | None:
    """Depths "0".."D-1" (depth k+1 is published as layer ``first_layer_id + k``, the block built as that layer);
    None for ``num_depths`` 0."""
    if num_depths == 0:
        return None
    return nn.ModuleDict(
        {str(k): MTPDepth(dim, build_block(first_layer_id + k), build_norm) for k in range(num_depths)}
    )


def mtp_ahead(tokens: torch.Tensor, embed: nn.Module, num_depths: int) -> Iterator[torch.Tensor]:
    """Each depth's embedding input (bs, seqlen, dim), depth 1 first: the tokens rolled left by k (token i+k at
    position i; the last k wrap, never trained), embedded. Lazy: each is computed when its depth reads it."""
    return (embed(tokens.roll(-k, dims=1)) for k in range(1, num_depths + 1))


def mtp_logits(
    mtp: nn.ModuleDict,
    h: torch.Tensor,
    ahead: Iterable[torch.Tensor],
    *,
    output: nn.Module,
    rope: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Each depth's logits (bs, seqlen, vocab), depth 1 first.

    h (bs, seqlen, dim): the model's final-normed hidden state; ahead: each depth's embedded tokens (``mtp_ahead``).
    """
    logits = []
    for depth, embedded in zip(mtp.values(), ahead, strict=True):
        h = depth(h, embedded, rope, doc_ids)
        logits.append(output(depth.norm(h)))
    return logits


def mtp_labels(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """(bs, seqlen) labels of MTP depth ``depth``: token i+depth+1 at position i, i.e. ``labels[i + depth]``.

    Ignored where that token is past the window, and where any of ``labels[i .. i+depth-1]`` is ignored: the chain
    to it crosses a document boundary (block_causal masks the label after each EOS) or a masked prompt (fine-tuning).
    """
    out = labels.roll(-depth, dims=1)
    for j in range(depth):
        out = out.masked_fill(labels.roll(-j, dims=1) == IGNORE_INDEX, IGNORE_INDEX)
    out[:, labels.shape[1] - depth :] = IGNORE_INDEX
    return out


# -- Hugging Face names (DeepSeek-V3's published layout): depth k+1 is ``model.layers.{n_layers + k}``, its block's
# weights under the block's usual names beside these; the embedding table and the head are the model's own, which a
# published folder stores again under the layer (equal copies).
MTP_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}  # our suffix under ``mtp.{k}.`` -> HF's under the layer
MTP_SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
"""HF suffix under an MTP layer -> the model's weight it copies."""


def mtp_as_layers(sd: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Our ``mtp.{k}.block.X`` -> ``layers.{n_layers + k}.X`` and ``mtp.{k}.enorm.weight`` (etc.) ->
    ``layers.{n_layers + k}.enorm.weight``: the depths named as the published layers, for the block's name map."""
    out = {}
    for key, w in sd.items():
        if not key.startswith("mtp."):
            out[key] = w
            continue
        _, k, rest = key.split(".", 2)
        out[f"layers.{n_layers + int(k)}.{rest.removeprefix('block.')}"] = w
    return out


def layers_as_mtp(sd: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """``mtp_as_layers``' inverse: ``layers.{n}.X`` with n >= ``n_layers`` -> ``mtp.{n - n_layers}.[block.]X``."""
    out = {}
    for key, w in sd.items():
        parts = key.split(".", 2)
        if parts[0] != "layers" or int(parts[1]) < n_layers:
            out[key] = w
            continue
        rest = parts[2] if parts[2] in MTP_OWN else f"block.{parts[2]}"
        out[f"mtp.{int(parts[1]) - n_layers}.{rest}"] = w
    return out


def held_mtp_layers(declared: int, n_layers: int, weight_names: Collection[str]) -> int:
    """The MTP layers a Hugging Face folder holds: of the ``declared`` ones (config.json's num_nextn_predict_layers),
    those whose ``eh_proj`` it stores, in order (transformers writes its default 1 with no MTP weight: it builds none).
    """
    held = 0
    while held < declared and f"model.layers.{n_layers + held}.eh_proj.weight" in weight_names:
        held += 1
    return held
