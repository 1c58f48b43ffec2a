"""The Hugging Face conversion toolkit: the weight mapping the families share, written once (name maps, tied embeddings, the RoPE row order of q/k, stacked
routed experts). A family's ``hf_adapter.py`` declares its maps and writes only its config.json fields; its
``ADAPTER`` satisfies ``torchtitan.spec.StateDictAdapter`` (the protocol lives there: models/ imports no spec).

RoPE: our ``apply_rotary_emb`` rotates interleaved pairs (x[2i], x[2i+1]) of each head; HF Llama-style
models rotate halves (x[i], x[i + head_dim/2]) ("rotate_half"). Attention scores only need q and k
permuted the same way, so exporting reorders the rows of wq/wk (and whatever acts on the same head_dim
before RoPE: biases, per-head norms) within each head: HF row i takes our row 2i, HF row i + head_dim/2
takes our row 2i+1. Importing inverts it. v/o are untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

# our name -> HF's, outside the blocks
TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows (heads * head_dim, ...): per head, pairs (2i, 2i+1) -> (i, i + head_dim/2)."""
    head_dim = w.shape[0] // n_heads
    return w.view(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    head_dim = w.shape[0] // n_heads
    return w.view(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class StackedExperts:
    """Our routed experts stacked (``feed_forward.experts.w1`` (E, out, in)) <-> one HF tensor per expert
    (``mlp.experts.{e}.gate_proj.weight``)."""

    names: Mapping[str, str] = field(default_factory=lambda: {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})

    def unstack(self, suffix: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """HF block suffix -> weight, for each expert of ours; None for a suffix that is not ours."""
        ours = suffix.removeprefix("feed_forward.experts.")
        if ours == suffix or ours not in self.names:
            return None
        return {f"mlp.experts.{e}.{self.names[ours]}.weight": w[e].contiguous() for e in range(w.shape[0])}

    def expert_of(self, suffix: str) -> tuple[int, str] | None:
        """HF ``mlp.experts.{e}.{gate_proj|up_proj|down_proj}.weight`` -> (e, our name); None for other suffixes."""
        parts = suffix.split(".")
        by_hf = {v: k for k, v in self.names.items()}
        if len(parts) == 5 and parts[:2] == ["mlp", "experts"] and parts[2].isdigit() and parts[3] in by_hf:
            return int(parts[2]), by_hf[parts[3]]
        return None

    def stack(self, found: dict[tuple[str, str], dict[int, torch.Tensor]], num_experts: int) -> dict[str, torch.Tensor]:
        """{(layer, our name): {e: weight}} -> our stacked weights.

        Raises:
            ValueError: a layer missing some of its experts.
        """
        out = {}
        for (layer, ours), per_expert in found.items():
            if sorted(per_expert) != list(range(num_experts)):
                raise ValueError(f"layer {layer}: expected experts 0..{num_experts - 1}, got {sorted(per_expert)}")
            out[f"layers.{layer}.feed_forward.experts.{ours}"] = torch.stack(
                [per_expert[e] for e in range(num_experts)]
            )
        return out


class HfAdapter:
    """The weight mapping of a Llama-style HF model, declared by a family's subclass: ``block`` (our suffix ->
    HF's, per layer), ``rope_rows`` (our suffix -> the head count its rows are RoPE-permuted by: "q", "kv" or
    "one"), ``experts`` (stacked routed experts, or None). Hooks for what only one family has:
    ``extra_to_hf`` / ``extra_from_hf`` (a weight outside the maps), ``finish_to_hf``.
    The family writes ``hf_config`` and ``model_args_from_hf``."""

    hf_name = "Llama"  # in errors: "unknown Hugging Face Llama weight"
    block: Mapping[str, str] = {}
    rope_rows: Mapping[str, str] = {}
    experts: StackedExperts | None = None
    skip_layers_past_n = False  # layers past n_layers (DeepSeek-V3's multi-token prediction) are not built
    unknown_hint = ""

    @property
    def block_names(self) -> Mapping[str, str]:
        return self.block

    def _permute(self, w: torch.Tensor, ours: str, args: dict[str, Any], *, to_hf: bool) -> torch.Tensor:
        kind = self.rope_rows.get(ours)
        if kind is None:
            return w
        n_heads = {"q": args["n_heads"], "kv": args.get("n_kv_heads") or args["n_heads"], "one": 1}[kind]
        return (interleaved_to_halves if to_hf else halves_to_interleaved)(w, n_heads)

    def to_hf_state_dict(self, sd: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        out = {}
        for key, w in sd.items():
            if key == "output.weight" and args.get("tie_word_embeddings"):
                continue  # the embedding table; HF's tie_word_embeddings shares it
            if key in TOP:
                out[TOP[key]] = w.contiguous()
                continue
            _, layer, suffix = key.split(".", 2) if key.startswith("layers.") else ("", "", key)
            mapped = self._block_to_hf(suffix, w, layer, sd, args) if layer else None
            if mapped is None:
                raise ValueError(f"no Hugging Face name for weight {key!r}")
            out.update({f"model.layers.{layer}.{k}": v for k, v in mapped.items()})
        return self.finish_to_hf(out, args)

    def _block_to_hf(self, suffix: str, w: torch.Tensor, layer: str, sd, args) -> dict[str, torch.Tensor] | None:
        if suffix in self.block:
            return {self.block[suffix]: self._permute(w, suffix, args, to_hf=True).contiguous()}
        per_expert = self.experts.unstack(suffix, w) if self.experts is not None else None
        return per_expert if per_expert is not None else self.extra_to_hf(suffix, w, layer, sd, args)

    def from_hf_state_dict(self, hf: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        top = {v: k for k, v in TOP.items()}
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for key, w in hf.items():
            if key in top:
                out[top[key]] = w.contiguous()
                continue
            parts = key.split(".", 3)  # model, layers, i, suffix
            ours = len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            if ours and self.skip_layers_past_n and int(parts[2]) >= args["n_layers"]:
                continue
            if not (ours and self._block_from_hf(parts[3], w, parts[2], args, out, experts)):
                if not key.endswith("rotary_emb.inv_freq"):  # a cache older HF versions saved
                    raise ValueError(f"unknown Hugging Face {self.hf_name} weight {key!r}{self.unknown_hint}")
        if experts:
            out.update(self.experts.stack(experts, args["num_experts"]))
        if args.get("tie_word_embeddings") and "tok_embeddings.weight" in out:
            # one tensor under both names, as the tied model's state dict holds it (a partial dict, e.g. one
            # layer's weights during a sharded load, has no embedding)
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    def _block_from_hf(self, suffix: str, w: torch.Tensor, layer: str, args, out, experts) -> bool:
        """Put one HF block weight into ``out`` (or ``experts``, to be stacked); False for one we do not know."""
        by_hf = {v: k for k, v in self.block.items()}
        expert = self.experts.expert_of(suffix) if self.experts is not None else None
        if suffix in by_hf:
            ours = by_hf[suffix]
            out[f"layers.{layer}.{ours}"] = self._permute(w, ours, args, to_hf=False).contiguous()
        elif expert is not None:
            experts.setdefault((layer, expert[1]), {})[expert[0]] = w
        else:
            extra = self.extra_from_hf(suffix, w, args)
            if extra is None:
                return False
            out.update({f"layers.{layer}.{k}": v for k, v in extra.items()})
        return True

    def extra_to_hf(self, suffix: str, w: torch.Tensor, layer: str, sd, args) -> dict[str, torch.Tensor] | None:
        """A block weight outside ``block`` and ``experts`` -> HF's (suffix -> tensor); None: no HF name."""
        return None

    def extra_from_hf(self, suffix: str, w: torch.Tensor, args: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """An HF block weight outside the maps -> ours (suffix -> tensor); None: not this family's."""
        return None

    def finish_to_hf(self, out: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The exported weights, after every one is mapped (DeepSeek-V3 adds the zero biases HF expects)."""
        return out


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``config.json``'s ``torch_dtype``."""
    return str(dtype).removeprefix("torch.")


def base_model_args(config: Mapping[str, Any], theta: float, *, norm_eps: float, max_len: int) -> dict[str, Any]:
    """The model args every family reads alike from ``config.json`` (``norm_eps`` and ``max_len``: the family's
    defaults, its transformers config class's)."""
    return {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "vocab_size": config["vocab_size"],
        "norm_eps": config.get("rms_norm_eps", norm_eps),
        "rope_theta": theta,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "max_seq_len": config.get("max_position_embeddings", max_len),
        "norm_type": "rmsnorm",
    }
