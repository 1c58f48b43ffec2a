"""The estimator's image batches (an image family on fine-tuning data): what the tower's activations are sized by.

Real windows hold as many images as their samples carry; the estimate assumes the most a window can hold, the same in
every row and step: square images of the largest size the processor allows (``max_pixels`` of the tokenizer folder's
``preprocessor_config.json``, else Qwen3.5's), shrunk until one fits the window with its ``<|vision_start|>`` and
``<|vision_end|>``, as many as fit, one sample per row with text after them. Each row's multimodal positions are
``mrope_positions``'; the pixel rows are random. The accuracy tests' real run draws the same batches, so the estimate
equals the tracker's there; for a run whose windows hold fewer image tokens it is an upper bound of the tower's share.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torchtitan.datasets.sft.packing import PackedDocs
from torchtitan.datasets.vision.processor import pixel_budget
from torchtitan.models.common.documents import IGNORE_INDEX
from torchtitan.models.qwen3_5.multimodal import ImageBatch, mrope_positions


def image_folder(tokenizer_path: str | None) -> str | None:
    """The folder whose ``preprocessor_config.json`` sizes the images: the tokenizer's, when it is on this machine."""
    from torchtitan.datasets.tokenizer import find_tokenizer_file

    found = find_tokenizer_file(tokenizer_path) if tokenizer_path else None
    return str(found.parent) if found is not None else None


def largest_images(vision: Any, seq_len: int, folder: str | None) -> tuple[tuple[int, int, int], int]:
    """(the image grid (1, side, side) in patches, images per window) the estimate assumes."""
    merge, factor = vision.spatial_merge_size, vision.patch_size * vision.spatial_merge_size
    _, max_pixels = pixel_budget(folder)
    blocks = max(1, math.isqrt(max_pixels) // factor)  # merge blocks per side
    while blocks > 1 and blocks * blocks + 2 > seq_len:
        blocks -= 1
    if blocks * blocks + 2 > seq_len:
        raise ValueError(
            f"estimation.py: one image of a single merge block needs 3 tokens with its vision tokens; training.seq_len "
            f"= {seq_len} holds none"
        )
    return (1, blocks * merge, blocks * merge), seq_len // (blocks * blocks + 2)


def describe(vision: Any, seq_len: int, folder: str | None) -> str:
    (_, h, w), count = largest_images(vision, seq_len, folder)
    tokens = h * w // vision.spatial_merge_size**2
    return (
        f"images assumed: {count} per window of {h}x{w} patches ({tokens} image tokens each; the largest the "
        f"processor's max_pixels and training.seq_len allow): an upper bound of the tower's share when windows hold "
        "fewer"
    )


class RandomImageBatches:
    """Endless (inputs, labels, PackedDocs with images) batches of the assumed layout, drawn when iterated (fake under
    fake mode)."""

    def __init__(self, batch_size: int, seq_len: int, vocab: int, args: Any, folder: str | None):
        self.batch_size, self.vocab, self.vision = batch_size, vocab, args.vision
        grid, count = largest_images(args.vision, seq_len, folder)
        self.grids = (grid,) * count
        tokens = grid[1] * grid[2] // args.vision.spatial_merge_size**2
        vision_tokens = (args.vision_start_token_id, args.image_token_id, args.vision_end_token_id)
        image = [vision_tokens[0], *[vision_tokens[1]] * tokens, vision_tokens[2]]
        row = (image * count + [0] * seq_len)[:seq_len]  # then text (id 0) to the window's end
        self.row, self.labels = row, [IGNORE_INDEX if t in vision_tokens else 0 for t in row]
        merge = args.vision.spatial_merge_size
        with unset_fake_temporarily():  # host bookkeeping, as the loader's
            positions = mrope_positions(torch.tensor([row]), list(self.grids), args.image_token_id, merge)
            self.positions = positions[:, 0].tolist()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, PackedDocs]]:
        bs, seq_len = self.batch_size, len(self.row)
        patches = sum(t * h * w for t, h, w in self.grids)
        values = self.vision.in_channels * self.vision.temporal_patch_size * self.vision.patch_size**2
        while True:
            tokens = torch.tensor([self.row] * bs)
            labels = torch.tensor([self.labels] * bs)
            positions = torch.tensor([self.positions] * bs).transpose(0, 1).contiguous()  # (3, bs, seq_len)
            images = ImageBatch(torch.randn(bs * patches, values), self.grids * bs, positions, (len(self.grids),) * bs)
            docs = torch.zeros(bs, seq_len, dtype=torch.long)
            per_doc = torch.arange(seq_len).expand(bs, -1).contiguous()
            yield tokens, labels, PackedDocs(docs, per_doc, torch.full((bs,), seq_len), images)
