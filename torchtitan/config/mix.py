"""``training.dataset_mix``: its entries parsed and checked (a leaf, so that the pre-launch check, the run records
and the data loader read it the same way)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torchtitan.config.errors import ConfigError

MIX_KEY = "training.dataset_mix"


@dataclass(frozen=True)
class MixEntry:
    """One source of a blend: an indexed prefix/folder, a local text file/folder or a registered name."""

    source: str
    weight: float  # normalised: the weights of a mix sum to 1


def parse_mix(entries: Sequence[str]) -> list[MixEntry]:
    """``["PATH_OR_NAME:WEIGHT", ...]`` -> entries with normalised weights.

    Raises:
        ConfigError: an entry without ``:WEIGHT``, a weight that is not a finite number or is negative, weights
            summing to 0, a source named twice.
    """
    if not entries:
        raise ConfigError(f'{MIX_KEY} is empty; give entries like ["data/web:0.7", "data/code:0.3"] or unset it')
    parsed: list[tuple[str, float]] = []
    for entry in entries:
        source, sep, text = str(entry).rpartition(":")
        if not sep or not source:
            raise ConfigError(
                f"{MIX_KEY} entry {entry!r} has no weight; write it as 'PATH_OR_NAME:WEIGHT', e.g. 'data/web:0.7'"
            )
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(
                f"{MIX_KEY} entry {entry!r}: the weight {text!r} is not a finite number >= 0; weights are "
                "non-negative numbers (normalised to sum to 1)"
            )
        parsed.append((source, weight))
    names = [s for s, _ in parsed]
    twice = sorted({s for s in names if names.count(s) > 1})
    if twice:
        raise ConfigError(f"{MIX_KEY} names {twice} more than once; give each source once, with its whole weight")
    total = sum(w for _, w in parsed)
    if total <= 0:
        raise ConfigError(f"{MIX_KEY} weights sum to {total}; at least one source needs a weight > 0")
    return [MixEntry(s, w / total) for s, w in parsed]


def describe_sources(dataset: str, dataset_path: str | None, mix: Sequence[str] | None) -> dict[str, list]:
    """The training data's sources and normalised weights, for run_info.json: the mix's, else the one dataset."""
    entries = parse_mix(mix) if mix is not None else [MixEntry(dataset_path or dataset, 1.0)]
    return {"sources": [e.source for e in entries], "weights": [e.weight for e in entries]}
