"""A chat prompt with images for generation (``scripts/generate.py --image``): the user's message shows the images
before its text, laid out as in training (datasets/vision/examples.py), with the images' pixel rows."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.datasets.sft.prompting import chat_prompt_ids
from torchtitan.datasets.vision.examples import IMAGE_MARKER, expand_image_pads, marked_text, vision_tokens
from torchtitan.datasets.vision.processor import ImageProcessor


def image_prompt(
    tokenizer: ChatTokenizer, model_args: Any, images: Sequence[str], user: str, *, system: str | None = None
) -> tuple[list[int], torch.Tensor, list[tuple[int, int, int]]]:
    """(prompt ids, pixel rows of every image, their grids) for a user message showing ``images`` then ``user``.

    Raises:
        ValueError: one line: a model without a vision tower, a missing or unreadable image, a tokenizer whose vision
            tokens are not the model's.
    """
    if getattr(model_args, "vision", None) is None:
        raise ValueError("--image needs an image model (qwen3_5_vl, qwen3_5_moe_vl); this one has no vision tower")
    tokens = vision_tokens(tokenizer, model_args)
    processor = ImageProcessor(model_args.vision, str(Path(tokenizer.base.path).parent))
    infos = [processor.info(path, "--image") for path in images]
    ids = chat_prompt_ids(tokenizer, marked_text(IMAGE_MARKER * len(infos) + user), system=system)
    ids, _ = expand_image_pads(ids, [0] * len(ids), infos, processor, tokens, "--image")
    return ids, torch.cat([processor.pixels(i) for i in infos]), [i.grid for i in infos]
