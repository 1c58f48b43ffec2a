"""The step's core data type: one micro-batch as a rank computes on it, and its documents (block_causal
attention, image-text data). The document feed (features/documents/feed.py) fills ``Batch.docs``; the step, the
loops and validation read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Documents:
    """One (local) batch's document ids (bs, seqlen) and, with positions_per_document, positions.

    ``stats``: (7,) int64 over the batch's whole windows (before context parallel cuts them):
    ``DocumentStats``' fields (``batch_stats``, then the images' patches and patch pairs).
    """

    doc_ids: torch.Tensor
    positions: torch.Tensor | None = None
    stats: torch.Tensor | None = None
    images: Any = None
    """Image-text data's images (``models.qwen3_5.multimodal.ImageBatch``: pixels, grids, multimodal positions),
    passed to the forward as ``images``; None for text."""

    def split(self, n: int) -> list[Documents]:
        ids = torch.tensor_split(self.doc_ids, n, dim=0)
        pos = torch.tensor_split(self.positions, n, dim=0) if self.positions is not None else [None] * n
        images = self.images.split(n) if self.images is not None else [None] * n
        return [Documents(i, p, images=m) for i, p, m in zip(ids, pos, images)]


@dataclass(frozen=True)
class Batch:
    """One micro-batch on the device, as this rank computes on it (cut for context parallel).

    ``inputs``, ``labels``: (bs, local seqlen). ``docs``: its documents under block_causal attention
    (``DocumentFeed.prepare``), else None.
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    docs: Documents | None = None
