"""Megatron-LM's blending rule, for weighted blends (``training.dataset_mix``, parsed in config/mix.py).

The rule (megatron-core ``helpers.cpp`` ``build_blending_indices``): sample ``n`` of the blend (n samples
already taken, ``c_j`` of them from source j) comes from the source with the largest deficit
``w_j * max(n, 1) - c_j``, the first such on a tie. Its running counts never drift from ``w_j * n`` by a
whole sample (tests/unit/test_indexed_loader.py checks it over 10,000 steps). It runs over the global sample
order, the same on every rank, so which source feeds each row of global batch k is a function of k only.
"""

from __future__ import annotations

from collections.abc import Sequence


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
