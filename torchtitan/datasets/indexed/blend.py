"""Weighted blends (``training.dataset_mix``): the entries parsed, and Megatron-LM's blending rule.

The rule (megatron-core ``helpers.cpp`` ``build_blending_indices``): sample ``n`` of the blend (n samples
already taken, ``c_j`` of them from source j) comes from the source with the largest deficit
``w_j * max(n, 1) - c_j``, the first such on a tie. Its running counts never drift from ``w_j * n`` by a
whole sample (tests/unit/test_indexed_blend.py checks it over 10,000 steps). It runs over the global sample
order, the same on every rank, so which source feeds each row of global batch k is a function of k only.
"""

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


class BlendRule:
    """Megatron's blending rule, resumable: ``counts[j]`` samples of source j taken since the mix started."""

    def __init__(self, weights: Sequence[float], counts: Sequence[int] | None = None) -> None:
        self.weights = [float(w) for w in weights]
        self.counts = [int(c) for c in counts] if counts is not None else [0] * len(self.weights)
        if len(self.counts) != len(self.weights):
            raise ValueError(f"{len(self.counts)} counts for {len(self.weights)} weights")

    def next(self) -> int:
        """The source of the next sample (its count is taken)."""
        n = max(sum(self.counts), 1)
        best, best_error = 0, self.weights[0] * n - self.counts[0]
        for j in range(1, len(self.weights)):
            error = self.weights[j] * n - self.counts[j]
            if error > best_error:
                best, best_error = j, error
        self.counts[best] += 1
        return best
