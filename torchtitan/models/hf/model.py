"""Any Hugging Face causal LM as a family (``model.name = "hf"``): transformers' own model class, built on the meta
device, under our parallelisms, initialisation, loss, data and checkpoints (docs/models.md, "Any Hugging Face
causal LM").

The model is transformers' ``AutoModelForCausalLM.from_config`` (SDPA attention, no KV cache in training) held as
``self.hf``: its weights keep transformers' names under an ``hf.`` prefix, so a local HF folder loads and exports
by stripping or adding that prefix. What the trainer reads from a family is added here: ``init_units`` (every
module initialised by transformers' own ``_init_weights``, the RNG reseeded from the seed and the module's name:
the same weights under every layout), ``init_buffers`` (the rotary tables, recomputed after ``to_empty``),
``forward(tokens, positions, return_hidden)`` and ``output`` (the head, for our chunked loss), ``decoder_layers``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# config.json fields that change what the causal LM's forward does after the head: our chunked loss applies the head
# itself, so it is refused where one is set
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
# the wrapper our parallelisms put around a module: activation checkpointing's (FSDP2 and in-place compile add none)
_WRAPPER = "_checkpoint_wrapped_module."


@dataclass(frozen=True)
class HFArgs:
    """A transformers config as our model args: the ``config.json`` fields (``config``, JSON text: hashable and
    frozen) and the shape fields our checks and metrics read, taken from them (``from_hf_config``)."""

    config: str = "{}"
    n_layers: int = 0
    dim: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    vocab_size: int = 0
    max_seq_len: int = 0
    norm_type: str = "rmsnorm"
    attention_backend: str = "sdpa"  # transformers' SDPA attention, its masks its own
    tie_word_embeddings: bool = False
    source: str = ""  # where the config came from (a flavor's name, or a folder)

    @property
    def config_dict(self) -> dict[str, Any]:
        return json.loads(self.config)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> HFArgs:
        """The args a checkpoint marker records (``dataclasses.asdict``), back as this class."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in known})


def _with_depth(fields: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """The config at ``n_layers`` (the memory estimator builds reduced depths); a per-layer schedule (``layer_types``)
    repeats its pattern."""
    if not n_layers or fields.get("num_hidden_layers") in (None, n_layers):
        return fields
    fields = {**fields, "num_hidden_layers": n_layers}
    if isinstance(fields.get("layer_types"), list) and fields["layer_types"]:
        pattern = fields["layer_types"]
        fields["layer_types"] = [pattern[i % len(pattern)] for i in range(n_layers)]
    return fields


def canonical_name(name: str) -> str:
    """A module's name without the wrappers our parallelisms add (the same name under every layout)."""
    return name.replace(_WRAPPER, "")


class HFCausalLM(nn.Module):
    """transformers' causal LM of ``args`` as ``self.hf``; ``build_transformers`` (set by models/hf/spec.py, which
    imports transformers: this module imports only torch) builds it from the config fields and the vocabulary."""

    build_transformers: Callable[[dict[str, Any], int], nn.Module]

    def __init__(self, args: HFArgs):
        super().__init__()
        self.args = args
        self.hf = type(self).build_transformers(_with_depth(args.config_dict, args.n_layers), args.vocab_size)

    # -- what the trainer reads ------------------------------------------------------------------------------
    @property
    def config(self):
        return self.hf.config

    @property
    def decoder(self) -> nn.Module:
        return self.hf.get_decoder()

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The decoder's repeated layers (FSDP's and activation checkpointing's units)."""
        layers = getattr(self.decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise NotImplementedError(
                f"model.name = 'hf': {type(self.hf).__name__} keeps no decoder layers at .layers; its layers are "
                "not found generically"
            )
        return layers

    @property
    def output(self) -> nn.Module:
        return self.hf.get_output_embeddings()

    def init_units(self) -> Iterator[tuple[str, Callable[[], None]]]:
        """(name, init) per module that owns parameters or buffers: transformers' own ``_init_weights``."""
        for name, module in self.hf.named_modules():
            if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
                yield f"hf.{canonical_name(name)}", functools.partial(self.hf._init_weights, module)

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """Re-tie a tied head (``to_empty`` gave it a parameter of its own), then fill the buffers (rotary tables, an
        embedding's scale) with transformers' ``_init_weights`` of their modules: a load of the weights comes after
        (tools that build the model to load a checkpoint), or ``init_units`` (training)."""
        if self.args.tie_word_embeddings:
            self.hf.get_output_embeddings().weight = self.hf.get_input_embeddings().weight
        for module in self.hf.modules():
            if any(True for _ in module.buffers(recurse=False)):
                self.hf._init_weights(module)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        self.init_buffers(buffer_device)
        for _, init in self.init_units():
            init()

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        *,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """tokens (bs, seqlen) -> logits (bs, seqlen, vocab), or the decoder's normed hidden state (``return_hidden``).

        Documents (``model.attn_mask_type = "block_causal"``): transformers reads them from ``positions`` restarting
        at each one (its packed-sequence mask, for full and sliding-window layers alike), so the family runs them
        with ``positions_per_document`` only (spec.py's check); ``doc_ids``, the same boundaries, is not needed.
        """
        position_ids = None
        if positions is not None:
            position_ids = positions if positions.dim() == 2 else positions[None].expand(tokens.shape[0], -1)
        if return_hidden:
            return self.decoder(input_ids=tokens, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.hf(input_ids=tokens, position_ids=position_ids, use_cache=False).logits


# transformers' TP plan styles this path applies (distributed/parallelize.py ``parallelize_hf``)
BUILT_TP_STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "rowwise_split_input",
    "replicated_with_grad_allreduce",
)


def unbuilt_tp_styles(plan: dict[str, str]) -> dict[str, str]:
    """The plan's entries (key -> style) not applied here: other styles, or keys outside the decoder's layers."""
    return {
        key: style for key, style in plan.items() if style not in BUILT_TP_STYLES or not key.startswith("layers.*.")
    }
