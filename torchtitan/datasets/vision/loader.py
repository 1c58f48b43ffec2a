"""Image-text fine-tuning: the text loader's packing and order (datasets/sft/loader.py: windows of whole examples,
the global batch's windows the same under any layout), with each window's images and its multimodal positions.

Each micro-batch yields ``PackedDocs`` whose ``images`` (``ImageBatch``) holds the pixel rows of the windows'
images, row after row and in text order (transformers' processor, decoded when the window is built), their grids,
and the (3, bs, seq_len) positions: ``mrope_positions`` of each packed sample from 0, as if it were alone (the
padding's count from 0 too). The model runs block-causal attention over the samples (the family's check requires
``model.attn_mask_type = "block_causal"``), so a packed sample computes what it would alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from torchtitan.datasets.sft.loader import RowSource, SFTDataset
from torchtitan.datasets.vision.examples import VisionTokens, build_image_example, vision_tokens
from torchtitan.datasets.vision.processor import ImageInfo, ImageProcessor
from torchtitan.models.qwen3_5.multimodal import ImageBatch, mrope_positions

if TYPE_CHECKING:
    from torchtitan.datasets.sft.chat_template import ChatTokenizer
    from torchtitan.datasets.sft.columns import ColumnMap
    from torchtitan.datasets.sft.packing import PackedDocs

logger = logging.getLogger(__name__)


def has_image_column(sources: Sequence[RowSource], columns: ColumnMap) -> bool:
    return any(columns.images in s.rows.column_names for s in sources)


def tokenize_image_rows(
    sources: Sequence[RowSource],
    chat: ChatTokenizer,
    processor: ImageProcessor,
    tokens: VisionTokens,
    *,
    loss_on: str,
    seq_len: int,
    columns: ColumnMap,
) -> tuple[list[tuple[Sequence[int], Sequence[int]]], list[tuple[ImageInfo, ...]]]:
    """Every row of ``sources`` as (tokens, labels), and its images (each image's size read, no pixels decoded).

    Raises:
        ValueError: one line naming the file and row of the first bad row (``build_image_example``).
    """
    examples, images = [], []
    for source in sources:
        base = os.path.dirname(os.path.abspath(source.name)) if os.path.exists(source.name) else "."
        for i, row in enumerate(source.rows):
            example = build_image_example(
                row,
                chat,
                processor,
                tokens,
                loss_on=loss_on,
                seq_len=seq_len,
                columns=columns,
                base=base,
                where=f"{source.name}: row {i}",
            )
            examples.append((example.tokens, example.labels))
            images.append(example.images)
    if not examples:
        raise ValueError(f"{', '.join(s.name for s in sources)}: no rows to fine-tune on")
    return examples, images


class ImageSFTDataset(SFTDataset):
    """``SFTDataset`` whose micro-batches carry their windows' images (``PackedDocs.images``).

    Args:
        images: each example's images, in the order of ``examples``.
        processor: decodes an image into its pixel rows.
        image_token_id, merge: the model's image pad and merge size (positions of the image tokens).
        other arguments: ``SFTDataset``'s.
    """

    def __init__(
        self,
        name: str,
        examples: Sequence[tuple[Sequence[int], Sequence[int]]],
        images: Sequence[tuple[ImageInfo, ...]],
        *,
        processor: ImageProcessor,
        image_token_id: int,
        merge: int,
        **kwargs: Any,
    ):
        super().__init__(name, examples, **kwargs)
        self._images, self._processor = list(images), processor
        self._image_token_id, self._merge = image_token_id, merge

    def batch(self, rows: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, PackedDocs]:
        tokens, labels, packed = super().batch(rows)
        pixels, grids, positions, counts = [], [], [], []
        for row_tokens, row, (*_, members) in zip(tokens, packed.doc_ids, rows):
            images = [image for m in members for image in self._images[m]]
            counts.append(len(images))
            pixels += [self._processor.pixels(image) for image in images]
            grids += [image.grid for image in images]
            positions.append(self._positions(row_tokens, row, [list(self._images[m]) for m in members]))
        values = torch.cat(pixels) if pixels else torch.zeros(0, self._patch_values())
        batch = ImageBatch(values, tuple(grids), torch.stack(positions, dim=1), tuple(counts))  # (3, bs, seq_len)
        return tokens, labels, packed._replace(images=batch)

    def _patch_values(self) -> int:
        p = self._processor
        return 3 * p.frames * p.patch**2

    def _positions(self, tokens: torch.Tensor, doc_ids: torch.Tensor, images: list[list[ImageInfo]]) -> torch.Tensor:
        """(3, seq_len): each sample's multimodal positions from 0 (the padding's too)."""
        lengths = torch.unique_consecutive(doc_ids, return_counts=True)[1].tolist()
        parts, start = [], 0
        for doc, length in enumerate(lengths):
            grids = [image.grid for image in images[doc]] if doc < len(images) else []
            piece = tokens[start : start + length][None]
            parts.append(mrope_positions(piece, grids, self._image_token_id, self._merge)[:, 0])
            start += length
        return torch.cat(parts, dim=1)


def build_image_dataset(
    name: str,
    sources: Sequence[RowSource],
    chat: ChatTokenizer,
    model_args: Any,
    *,
    loss_on: str,
    columns: ColumnMap,
    **kwargs: Any,
) -> ImageSFTDataset:
    """The image-text dataset of ``sources`` for a model with a vision tower (``model_args.vision``).

    Raises:
        ValueError: a text-only model (its args have no tower), the tokenizer's vision tokens not the model's, or a
            bad row (one line each).
    """
    if getattr(model_args, "vision", None) is None:
        raise ValueError(
            f"{name}: the rows have images ('{columns.images}'), and the model has no vision tower; use the family's "
            "image model (e.g. model.name = 'qwen3_5_vl'), or drop the images column"
        )
    tokens = vision_tokens(chat, model_args)
    processor = ImageProcessor(model_args.vision, os.path.dirname(chat.base.path))
    examples, images = tokenize_image_rows(
        sources, chat, processor, tokens, loss_on=loss_on, seq_len=kwargs["seq_len"], columns=columns
    )
    count = sum(len(i) for i in images)
    logger.info("image data %s: %d images in %d rows (%s)", name, count, len(examples), processor.settings)
    merge = model_args.vision.spatial_merge_size
    return ImageSFTDataset(
        name, examples, images, processor=processor, image_token_id=tokens.pad, merge=merge, **kwargs
    )
