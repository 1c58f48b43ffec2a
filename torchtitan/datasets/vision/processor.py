"""Images -> the tower's input: transformers' image processor for Qwen3.5 (``Qwen2VLImageProcessorPil``: resize to
multiples of patch x merge within a pixel budget, rescale, normalise, cut into patch rows in merge-block order).

Its settings are the model folder's ``preprocessor_config.json`` when the tokenizer folder holds one (a published
model's, or the shipped shapes task's), else Qwen3.5's published ones (mean and std 0.5, 256x256 to 4096x4096
pixels), with the patch, frame and merge sizes of the model's tower. The number of image tokens an image gives is
known from its size alone (``grid``: the file's header is read, not its pixels), so the text is laid out before any
pixel is decoded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchtitan.config.parse_errors import parsing

if TYPE_CHECKING:
    from torchtitan.models.qwen3_5.vision import VisionArgs

PREPROCESSOR_FILE = "preprocessor_config.json"
# Qwen3.5's published preprocessor_config.json (what a folder without one gets)
DEFAULTS = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "min_pixels": 65536, "max_pixels": 16777216}


def _processor_class() -> type:
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError as e:
        raise ImportError(
            f"image data needs transformers' image processor and Pillow ({e}); install them: "
            "pip install 'torchtitan[vision]'"
        ) from None
    return Qwen2VLImageProcessorPil


@dataclass(frozen=True)
class ImageInfo:
    """One image of a row: its file and the (frames, patch rows, patch columns) grid the processor gives it."""

    path: str
    grid: tuple[int, int, int]


def pixel_budget(folder: str | None) -> tuple[int, int]:
    """(min_pixels, max_pixels) of the tokenizer folder's ``preprocessor_config.json``, else Qwen3.5's published ones
    (read without transformers: the memory estimator sizes its images with it)."""
    read: dict[str, Any] = {}
    config = Path(folder) / PREPROCESSOR_FILE if folder else None
    if config is not None and config.is_file():
        read = _read_json(config)
    size = read.get("size") or {}
    low = int(read.get("min_pixels", size.get("shortest_edge", DEFAULTS["min_pixels"])))
    return low, int(read.get("max_pixels", size.get("longest_edge", DEFAULTS["max_pixels"])))


class ImageProcessor:
    """The family's image processor over local files.

    Args:
        vision: the model's tower (patch, frame and merge sizes).
        folder: the tokenizer's folder; its ``preprocessor_config.json`` is read when present.
    """

    def __init__(self, vision: VisionArgs, folder: str | None = None):
        read: dict[str, Any] = {}
        config = Path(folder) / PREPROCESSOR_FILE if folder is not None else None
        if config is not None and config.is_file():
            read = _read_json(config)
        self.min_pixels, self.max_pixels = pixel_budget(folder)
        mean, std = read.get("image_mean", DEFAULTS["image_mean"]), read.get("image_std", DEFAULTS["image_std"])
        self.patch, self.merge, self.frames = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
        settings = dict(image_mean=mean, image_std=std, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        self.settings: dict[str, Any] = settings
        self._processor = _processor_class()(
            patch_size=self.patch, temporal_patch_size=self.frames, merge_size=self.merge, **settings
        )

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Image tokens of a grid: one per merge block."""
        return grid[0] * grid[1] * grid[2] // self.merge**2

    def info(self, path: str, where: str) -> ImageInfo:
        """The image's grid, from its size (the header only).

        Raises:
            ValueError: one line naming ``where`` and the file: missing, unreadable or not an image.
        """
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        height, width = _size(path, where)
        factor = self.patch * self.merge
        try:
            h, w = smart_resize(height, width, factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        except ValueError as e:
            raise ValueError(f"{where}: image {path} ({width}x{height}): {e}") from None
        return ImageInfo(path, (1, h // self.patch, w // self.patch))

    def pixels(self, image: ImageInfo) -> torch.Tensor:
        """The image's patch rows (patches, channels x frames x patch x patch), float32."""
        from PIL import Image

        # its header was read when the text was laid out; its pixels are decoded here (a file cut short fails here)
        with parsing(image.path, "a readable image", fix="copy the image again", errors=(OSError,)):
            with Image.open(image.path) as img:
                rgb = img.convert("RGB")
        out = self._processor(images=rgb, return_tensors="np")
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        if grid != image.grid:  # the file changed since its size was read
            raise ValueError(f"image {image.path}: its grid is now {grid}, {image.grid} when the text was laid out")
        return torch.from_numpy(np.ascontiguousarray(out["pixel_values"], dtype=np.float32))


def _read_json(path: Path) -> dict[str, Any]:
    with parsing(path, "valid JSON", fix="fix that line, or save the processor again with save_pretrained"):
        return json.loads(path.read_text(encoding="utf-8"))


def _size(path: str, where: str) -> tuple[int, int]:
    """(height, width) of an image file, read from its header."""
    from PIL import Image, UnidentifiedImageError

    if not Path(path).is_file():
        raise ValueError(f"{where}: image {path} does not exist; images are paths relative to the data file's folder")
    try:
        with Image.open(path) as img:
            width, height = img.size
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{where}: image {path} is not a readable image ({type(e).__name__}: {e})") from None
    return height, width
