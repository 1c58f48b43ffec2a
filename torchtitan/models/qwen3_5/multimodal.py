"""Qwen3.5 with images (transformers' ``Qwen3_5ForConditionalGeneration``): the vision tower's tokens placed in the
text sequence, and multimodal RoPE positions over time, height and width.

The text holds one ``image_token_id`` per image token (the chat template's ``<|vision_start|>`` then as many image
pads as the image gives tokens, then ``<|vision_end|>``). The tower (vision.py) turns each image's patches into
(frames x rows x columns) / merge^2 tokens, which replace the pads' embeddings in order. Positions
(``mrope_positions``, transformers' ``get_rope_index`` rules): text tokens count on from the last position on all
three axes; an image's tokens sit on a grid from the current position (time, row, column), and the text after it
continues from the current position plus the larger of the grid's rows and columns. The language model is the
text model (dense or MoE) unchanged; its ``rope_at`` turns the three axes into the rotary angles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from torchtitan.models.qwen3_5.model import Qwen35Args, Qwen35Transformer
from torchtitan.models.qwen3_5.vision import VisionArgs, VisionTower


@dataclass(frozen=True)
class Qwen35VLArgs:
    """The language model's args, the tower's, and the special tokens the template uses."""

    text: Qwen35Args = field(default_factory=Qwen35Args)
    vision: VisionArgs = field(default_factory=VisionArgs)
    image_token_id: int = 248056
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054


def mrope_positions(
    tokens: torch.Tensor, grid_thw: list[tuple[int, int, int]], image_token_id: int, merge: int
) -> torch.Tensor:
    """tokens (bs, seqlen), each row's images in order in ``grid_thw`` (row after row) -> positions (3, bs, seqlen)
    of time, height and width. Each run of image tokens is one image (the template puts vision_start / vision_end
    around each).

    Raises:
        ValueError: a run of image tokens whose length is not its image's token count, or more runs than images.
    """
    grids = iter(grid_thw)
    rows = []
    for row in tokens.tolist():
        parts, position, i = [], 0, 0
        while i < len(row):
            j = i
            image = row[i] == image_token_id
            while j < len(row) and (row[j] == image_token_id) == image:
                j += 1
            if not image:
                parts.append(torch.arange(position, position + j - i).expand(3, -1))
                position += j - i
            else:
                grid, position = _image_positions(next(grids, None), j - i, merge, position)
                parts.append(grid)
            i = j
        rows.append(torch.cat(parts, dim=1))
    return torch.stack(rows, dim=1).to(tokens.device)


def _image_positions(
    grid: tuple[int, int, int] | None, tokens: int, merge: int, position: int
) -> tuple[torch.Tensor, int]:
    """One image's (3, tokens) positions from ``position``, and the position after it."""
    if grid is None:
        raise ValueError(f"a run of {tokens} image tokens has no image left in grid_thw: one image per run")
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    if t * h * w != tokens:
        raise ValueError(
            f"an image of grid (t, h, w) = {tuple(grid)} gives {t * h * w} tokens (merge {merge}), but its run in the "
            f"text has {tokens} image tokens; build the text with the processor's token count for that image"
        )
    axes = torch.meshgrid(torch.arange(t), torch.arange(h) + position, torch.arange(w) + position, indexing="ij")
    positions = torch.stack(axes).reshape(3, -1)
    positions[0] += position
    return positions, position + max(h, w)


class Qwen35VL(nn.Module):
    """The vision tower and the language model (``text_cls``: the dense or the MoE hybrid)."""

    def __init__(self, args: Qwen35VLArgs, text_cls: type[Qwen35Transformer] = Qwen35Transformer):
        super().__init__()
        self.args = args
        self.visual = VisionTower(args.vision)
        self.language_model = text_cls(args.text)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        self.visual.init_weights()
        self.language_model.init_weights(buffer_device)

    def forward(
        self,
        tokens: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        grid_thw: list[tuple[int, int, int]] | None = None,
        positions: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """tokens (bs, seqlen) with the image pads; pixel_values (patches, patch_values) of every image, row after
        row, and their grid_thw; positions (3, bs, seqlen) (default: ``mrope_positions``) -> logits.

        Raises:
            ValueError: image pads and image tokens that do not match in count.
        """
        a = self.args
        h = self.language_model.tok_embeddings(tokens)  # (bs, seqlen, dim)
        if pixel_values is not None:
            features = self.visual(pixel_values, grid_thw)  # (image tokens, dim)
            pads = tokens == a.image_token_id
            if int(pads.sum()) != features.shape[0]:
                raise ValueError(
                    f"the text has {int(pads.sum())} image tokens and its images give {features.shape[0]}; build the "
                    "text with the processor's token count for each image"
                )
            h = h.masked_scatter(pads[..., None], features.to(h.dtype))
        if positions is None:
            positions = mrope_positions(tokens, grid_thw or [], a.image_token_id, a.vision.spatial_merge_size)
        return self.language_model(h, positions, **kwargs)


__all__ = ["Qwen35VL", "Qwen35VLArgs", "mrope_positions"]
