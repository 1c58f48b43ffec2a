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

from torchtitan.models.qwen3_5.model import Qwen35Args, Qwen35MoEArgs, Qwen35MoETransformer, Qwen35Transformer
from torchtitan.models.qwen3_5.vision import VisionArgs, VisionTower


@dataclass(frozen=True)
class VisionFields:
    """What a text model's args gain with images: the tower's shape and the special tokens the template uses."""

    vision: VisionArgs = field(default_factory=VisionArgs)
    image_token_id: int = 248056
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    def image_flops(self, patches: int, patch_pairs: int) -> float:
        """The tower's training FLOPs (forward and backward, MFU's 6 per weight and 12 per attention pair and width,
        as the text model's) for ``patches`` patches whose frames attend over ``patch_pairs`` (query, key) pairs:
        the patch embedding and blocks per patch, the merger per merged token."""
        v = self.vision
        merged = v.dim * v.spatial_merge_size**2
        per_patch = v.patch_values * v.dim + v.depth * (4 * v.dim**2 + 2 * v.dim * v.ffn_dim)
        merger = (merged * merged + merged * v.out_dim) / v.spatial_merge_size**2
        return 6 * (per_patch + merger) * patches + 12 * v.depth * v.dim * patch_pairs


@dataclass(frozen=True)
class Qwen35VLArgs(Qwen35Args, VisionFields):
    """The dense hybrid with the tower (``qwen3_5_vl``)."""


@dataclass(frozen=True)
class Qwen35MoEVLArgs(Qwen35MoEArgs, VisionFields):
    """The MoE hybrid with the tower (``qwen3_5_moe_vl``)."""


@dataclass(frozen=True)
class ImageBatch:
    """A batch's images as the trainer feeds them (beside the tokens, through a forward pre-hook): every image's
    patches row after row (``pixel_values``, the processor's), their grids (read on the host), and the
    (3, bs, seqlen) multimodal positions of the batch, restarting at each packed sample (the loader's)."""

    pixel_values: torch.Tensor
    grid_thw: tuple[tuple[int, int, int], ...]
    positions: torch.Tensor
    row_images: tuple[int, ...]
    """How many of the images each row holds (rows in order): a pipeline's micro-batches take their rows' images."""

    def to(self, device: torch.device) -> ImageBatch:
        return ImageBatch(self.pixel_values.to(device), self.grid_thw, self.positions.to(device), self.row_images)

    def split(self, n: int) -> list[ImageBatch]:
        """The batch's rows in ``n`` pieces as ``tensor_split`` cuts them (a pipeline schedule's micro-batches)."""
        pieces, row, image, patch = [], 0, 0, 0
        for positions in torch.tensor_split(self.positions, n, dim=1):
            counts = self.row_images[row : row + positions.shape[1]]
            grids = self.grid_thw[image : image + sum(counts)]
            patches = sum(t * h * w for t, h, w in grids)
            pieces.append(ImageBatch(self.pixel_values[patch : patch + patches], grids, positions, counts))
            row, image, patch = row + positions.shape[1], image + sum(counts), patch + patches
        return pieces


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


class ImagePlacement(nn.Module):
    """The image features in place of the pads' embeddings (no parameters): its own module so tensor parallel can
    split the sequence after it (the embedding then leaves it whole)."""

    def forward(self, h: torch.Tensor, pads: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """h (bs, seqlen, dim); pads (bs, seqlen) bool; features (pads, dim) or None (text only)."""
        return h if features is None else h.masked_scatter(pads[..., None], features.to(h.dtype))


class VisionModel:
    """The tower beside a text model (a mixin before ``Qwen35Transformer`` or ``Qwen35MoETransformer``): one module
    tree, the text model's names (``tok_embeddings``, ``layers``, ``norm``, ``output``) plus ``visual``, so the
    trainer's layouts, LoRA and checkpoints take it as the text family."""

    input_modules = ("tok_embeddings", "visual")  # the tower's features are placed in the embedding: one end

    def __init__(self, args: Qwen35VLArgs):
        super().__init__(args)
        self.visual = VisionTower(args.vision)
        self.place_images = ImagePlacement()

    def freeze_vision(self) -> None:
        """``model.freeze_vision``: the tower's patch embedding, positions and blocks stop training (its merger and
        the language model train)."""
        if getattr(self, "visual", None) is not None:
            self.visual.requires_grad_(False)
            self.visual.merger.requires_grad_(True)

    def _blank_image(self, h: torch.Tensor) -> torch.Tensor:
        """The tower run on one blank image of a single merge block (a scalar of its output, times 0 by the caller).

        With image data every rank runs the tower in every micro-batch, even one whose windows hold no image: under
        FSDP the tower's units gather their parameters and reduce their gradients in collectives every rank must
        join (a rank skipping them would hang the others), and under DDP its parameters must take part. The blank
        image adds zero to the logits and zero to the gradients.
        """
        v, merge = self.args.vision, self.args.vision.spatial_merge_size
        blank = torch.zeros(merge * merge, v.patch_values, device=h.device, dtype=h.dtype)
        return self.visual(blank, [(1, merge, merge)]).sum()

    def init_units(self):
        yield from super().init_units()
        if getattr(self, "visual", None) is not None:
            yield "visual", self.visual.init_weights

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        grid_thw: list[tuple[int, int, int]] | None = None,
        images: ImageBatch | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """tokens (bs, seqlen) with the image pads; either ``pixel_values`` (patches, patch_values) of every image,
        row after row, with their ``grid_thw`` (positions default to ``mrope_positions``), or the trainer's
        ``images`` (positions and counts prepared by the loader) -> logits (the text model's ``kwargs``: doc_ids,
        return_hidden).

        Raises:
            ValueError: image pads and image tokens that do not match in count (``pixel_values`` only).
        """
        a = self.args
        if images is not None:
            pixel_values, grid_thw, positions = images.pixel_values, list(images.grid_thw), images.positions
        if tokens.is_floating_point() or self.tok_embeddings is None:  # a later pipeline stage's hidden state
            return super().forward(tokens, positions, **kwargs)
        h = self.tok_embeddings(tokens)  # (bs, seqlen, dim)
        pads, features = tokens == a.image_token_id, None
        if self.visual is not None and pixel_values is not None and pixel_values.shape[0]:
            features = self.visual(pixel_values, grid_thw)  # (image tokens, dim)
            if images is None and int(pads.sum()) != features.shape[0]:  # the loader checked its own
                raise ValueError(
                    f"the text has {int(pads.sum())} image tokens and its images give {features.shape[0]}; build the "
                    "text with the processor's token count for each image"
                )
        elif self.visual is not None and images is not None:
            h = h + 0 * self._blank_image(h)  # image data, no image on this rank: see _blank_image
        h = self.place_images(h, pads, features)
        if positions is None and pixel_values is not None:
            positions = mrope_positions(tokens, grid_thw or [], a.image_token_id, a.vision.spatial_merge_size)
        return super().forward(h, positions, **kwargs)


class ImagePrompt(nn.Module):
    """An image model bound to one prompt's images, for generation (``components.generation.generate`` calls it as a
    text model): a forward from position 0 is the prompt (its images placed, multimodal positions); a later one (the
    KV cache's new tokens at ``positions``) continues from the prompt's last position, as transformers' rope deltas
    do. Without the cache every forward is the whole sequence from 0.

    Args:
        model: a ``VisionModel`` (one row: the prompt's images are its own).
        pixel_values, grid_thw: the prompt's images, as the processor gives them.
    """

    def __init__(self, model: nn.Module, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]):
        super().__init__()
        self.model, self.pixel_values, self.grid_thw = model, pixel_values, list(grid_thw)
        self.shift = 0  # the prompt's last multimodal position + 1, minus its length

    @property
    def layers(self) -> nn.ModuleDict:  # the KV cache's seam (KVCache.install)
        return self.model.layers

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is not None and int(positions[0]) > 0:  # cached decoding: text after the prompt
            return self.model(tokens, positions + self.shift)
        a = self.model.args
        full = mrope_positions(tokens, self.grid_thw, a.image_token_id, a.vision.spatial_merge_size)
        self.shift = int(full.max()) + 1 - tokens.shape[1]
        return self.model(tokens, full, pixel_values=self.pixel_values, grid_thw=self.grid_thw)


class Qwen35VL(VisionModel, Qwen35Transformer):
    """Qwen3.5 with images (transformers' ``Qwen3_5ForConditionalGeneration``)."""


class Qwen35MoEVL(VisionModel, Qwen35MoETransformer):
    """Qwen3.5-MoE with images (``Qwen3_5MoeForConditionalGeneration``)."""


__all__ = [
    "ImageBatch",
    "ImagePrompt",
    "Qwen35MoEVL",
    "Qwen35MoEVLArgs",
    "Qwen35VL",
    "Qwen35VLArgs",
    "VisionFields",
    "mrope_positions",
]
