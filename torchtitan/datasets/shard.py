"""Which part of every global batch a rank reads (the data-parallel rank and degree the loaders take)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class DataShard:
    """Data-parallel rank ``rank`` of ``degree``: the rank reads streams ``rank * b * a`` .. (see
    ``hf_datasets.compute_stream_groups``). Under fault tolerance the replica groups sit side by side, group
    ``i``'s ranks being ``i * dp .. i * dp + dp - 1`` of ``group_size * dp`` (HSDP's replicate-outer order)."""

    rank: int
    degree: int


@runtime_checkable
class ReportsDataMix(Protocol):
    """A loader that reports, per step, what each of its sources gave (a blend: datasets/indexed/loader.py)."""

    def step_metrics(self) -> tuple[dict[str, Any], dict[str, float]]:
        """(metrics.jsonl fields, TensorBoard scalars) of the last step read."""
