"""A Hugging Face config's RoPE, read and written one way for every family: transformers 5's.

Reading (``PreTrainedConfig``'s ``convert_rope_params_to_dict`` and ``standardize_rope_params``):

1. the RoPE dict is ``rope_scaling`` (the legacy key) when it is set and not empty, else ``rope_parameters``,
   else the family's default (gpt-oss: its published YaRN; the others: none);
2. theta is that dict's ``rope_theta``, else the top-level ``rope_theta``, else the family's default;
3. the type is ``rope_type``, else the legacy ``type``, else ``"default"``;
4. a scaled type (``llama3``, ``yarn``) without ``original_max_position_embeddings`` takes
   ``max_position_embeddings``; YaRN needs its ``factor`` key (transformers raises without it), and a
   ``factor`` of null means ``max_position_embeddings / original_max_position_embeddings``.

Writing: ``rope_parameters`` only (``rope_type``, ``rope_theta`` and the type's keys), as transformers 5's
``save_pretrained`` writes ``config.json``; no top-level ``rope_theta`` or ``rope_scaling``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchtitan.models.common.rope.yarn import YarnScaling

# HF key -> our field, per scaled RoPE type: llama's RopeScaling, YarnScaling
_LLAMA3 = {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_max_seq_len",
}
_YARN = {
    "factor": "factor",
    "original_max_position_embeddings": "original_max_seq_len",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
    "attention_factor": "attention_factor",
    "truncate": "truncate",
}
SCALING_KEYS: dict[str, dict[str, str]] = {"llama3": _LLAMA3, "yarn": _YARN}
# the keys transformers requires of each type (besides original_max_position_embeddings, which it fills in)
_REQUIRED = {"llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
# YarnScaling's "not given" values: not written
_UNSET = {"mscale": 0.0, "mscale_all_dim": 0.0, "attention_factor": None}


@dataclass(frozen=True)
class RopeDefaults:
    """What a family's transformers config class assumes where config.json says nothing."""

    theta: float = 10000.0
    max_position_embeddings: int = 2048
    parameters: Mapping[str, Any] | None = None  # the RoPE dict when neither rope_scaling nor rope_parameters is set


@dataclass(frozen=True)
class HfRope:
    """A config's RoPE in our terms: theta, the type and its scaling (RopeScaling's or YarnScaling's fields)."""

    theta: float
    rope_type: str
    scaling: dict[str, Any] | None


def rope_parameters(config: Mapping[str, Any], defaults: RopeDefaults = RopeDefaults()) -> dict[str, Any]:
    """The config's ``rope_parameters`` as transformers 5 standardizes them (steps 1-4 of the module docstring)."""
    chosen = config.get("rope_scaling") or config.get("rope_parameters")
    params = dict(chosen if chosen is not None else defaults.parameters or {})
    top_theta = config.get("rope_theta")
    params.setdefault("rope_theta", defaults.theta if top_theta is None else top_theta)
    params.setdefault("rope_type", params.get("type", "default"))
    params.pop("type", None)
    if params["rope_type"] in SCALING_KEYS:
        max_len = config.get("max_position_embeddings", defaults.max_position_embeddings)
        params.setdefault("original_max_position_embeddings", max_len)
    return params


def parse_hf_rope(
    config: Mapping[str, Any], *, family: str, supports: tuple[str, ...], defaults: RopeDefaults = RopeDefaults()
) -> HfRope:
    """``config.json``'s RoPE -> ours, for a family whose model implements the RoPE types ``supports``.

    Raises:
        ValueError: a type the family does not implement, a key the type does not read, or a required key
            missing (one line naming the key, the value and what is allowed).
    """
    params = rope_parameters(config, defaults)
    kind, where = params["rope_type"], "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    if kind not in supports:
        raise ValueError(
            f"HF config {where}.rope_type = {kind!r}: our {family} implements {' and '.join(map(repr, supports))} "
            "RoPE; convert a model of another RoPE type with the family that implements it"
        )
    theta = float(params["rope_theta"])
    if kind == "default":
        return HfRope(theta, kind, None)
    keys = SCALING_KEYS[kind]
    unknown = sorted(set(params) - {*keys, "rope_type", "rope_theta"})
    missing = [k for k in _REQUIRED[kind] if k not in params]
    if unknown or missing:
        what = f"has {', '.join(unknown)}" if unknown else f"has no {', '.join(missing)}"
        raise ValueError(
            f"HF config {where} (rope_type {kind!r}) {what}: our {family}'s {kind} RoPE reads "
            f"{', '.join(keys)} (required: {', '.join(_REQUIRED[kind])}); fix the config's {where}"
        )
    scaling = {ours: params[hf] for hf, ours in keys.items() if params.get(hf) is not None}
    if kind == "yarn":
        if params["factor"] is None:  # transformers: the stretch of max_position_embeddings
            max_len = config.get("max_position_embeddings", defaults.max_position_embeddings)
            scaling["factor"] = max_len / params["original_max_position_embeddings"]
        scaling = dataclasses.asdict(YarnScaling(**scaling))
    return HfRope(theta, kind, scaling)


def hf_rope_parameters(theta: float, rope_type: str, scaling: Mapping[str, Any] | None) -> dict[str, Any]:
    """Our RoPE -> ``config.json``'s ``rope_parameters`` (what transformers 5 writes)."""
    out: dict[str, Any] = {"rope_type": rope_type, "rope_theta": theta}
    for hf, ours in SCALING_KEYS.get(rope_type, {}).items():
        value = (scaling or {}).get(ours)
        if value is not None and (hf not in _UNSET or value != _UNSET[hf]):
            out[hf] = value
    return out
