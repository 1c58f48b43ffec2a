"""One image-text chat row -> ``ImageExample``: tokens and labels as a text row's (datasets/sft/examples.py), each
image in place as ``<|vision_start|>``, as many ``<|image_pad|>`` as the image gives tokens, ``<|vision_end|>``
(what transformers' Qwen3.5 processor writes), and the row's images in order.

Row shape (the popular image SFT datasets'): ``{"messages": [...], "images": ["a.png", ...]}``, paths relative to
the data file's folder. A message's content is a string with one ``<image>`` marker per image, or a list of parts
``{"type": "image"}`` / ``{"type": "text", "text": ...}``; the markers, over all messages in order, take the images
in order. Image tokens are never trained (they sit in user turns; a marker in an assistant turn is refused).
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.datasets.sft.columns import ColumnMap
from torchtitan.datasets.sft.examples import LossOn, build_example
from torchtitan.datasets.vision.processor import ImageInfo, ImageProcessor
from torchtitan.models.common.documents import IGNORE_INDEX

IMAGE_MARKER = "<image>"
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


@dataclass(frozen=True)
class ImageExample:
    """A packed-ready example: ``tokens`` and ``labels`` (equal length, pads expanded) and its images in order."""

    tokens: Sequence[int]
    labels: Sequence[int]
    images: tuple[ImageInfo, ...]


@dataclass(frozen=True)
class VisionTokens:
    """The tokenizer's ids of the three vision tokens (checked against the model's args by the loader)."""

    start: int
    pad: int
    end: int


def vision_tokens(chat: ChatTokenizer, args: Any) -> VisionTokens:
    """The tokenizer's ids of the vision tokens, which must be the model's.

    Raises:
        ValueError: a token the tokenizer lacks, or an id other than the model args'.
    """
    names = {"start": (VISION_START, "vision_start_token_id"), "pad": (IMAGE_PAD, "image_token_id")}
    names["end"] = (VISION_END, "vision_end_token_id")
    ids = {}
    for key, (token, field) in names.items():
        found = chat.token_id(token)
        if found is None:
            raise ValueError(
                f"image data: the tokenizer {chat.base.path} has no {token} token; use the model's tokenizer (its "
                f"vision tokens {VISION_START} {IMAGE_PAD} {VISION_END})"
            )
        if found != getattr(args, field):
            raise ValueError(
                f"image data: the tokenizer's {token} is id {found}, the model's {field} is "
                f"{getattr(args, field)}; use the tokenizer the model was built for"
            )
        ids[key] = found
    return VisionTokens(**ids)


def marked_text(text: str) -> str:
    """Text with each ``<image>`` marker as the vision tokens' text (one pad, expanded after tokenization)."""
    return text.replace(IMAGE_MARKER, VISION_START + IMAGE_PAD + VISION_END)


def _content_text(content: Any, where: str, index: int) -> tuple[str, int]:
    """A message's content as text with its image markers replaced, and how many there were."""
    if isinstance(content, str):
        return marked_text(content), content.count(IMAGE_MARKER)
    if not isinstance(content, list):
        raise ValueError(f"{where}: message {index} content is a {type(content).__name__}; a string or a list of parts")
    text, images = [], 0
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "image":
            text.append(VISION_START + IMAGE_PAD + VISION_END)
            images += 1
        elif kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        else:
            raise ValueError(
                f"{where}: message {index} has the part {part!r}; parts are {{'type': 'image'}} or "
                "{'type': 'text', 'text': str}"
            )
    return "".join(text), images


def _messages(row: Mapping[str, Any], columns: ColumnMap, where: str) -> tuple[list[dict], int]:
    raw = row.get(columns.messages)
    if not isinstance(raw, list):
        raise ValueError(f"{where}: '{columns.messages}' must be a list of messages, got {type(raw).__name__}")
    messages, markers = [], 0
    for i, message in enumerate(raw):
        if not isinstance(message, Mapping):
            raise ValueError(f"{where}: message {i} is a {type(message).__name__}, expected an object")
        text, n = _content_text(message.get(columns.content), where, i)
        if n and message.get(columns.role) == "assistant":
            raise ValueError(f"{where}: message {i} (assistant) holds an image; images go in user or system turns")
        messages.append({**message, columns.content: text})
        markers += n
    return messages, markers


def _image_paths(row: Mapping[str, Any], columns: ColumnMap, base: str, where: str) -> list[str]:
    paths = row.get(columns.images) or []
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ValueError(f"{where}: '{columns.images}' must be a list of image file paths, got {paths!r}")
    return [p if os.path.isabs(p) else os.path.join(base, p) for p in paths]


def expand_image_pads(
    tokens: Sequence[int],
    labels: Sequence[int],
    images: Sequence[ImageInfo],
    processor: ImageProcessor,
    vision_tokens: VisionTokens,
    where: str,
) -> tuple[array, array]:
    """Each image's one pad -> as many as the image gives tokens (the added pads' labels ignored).

    Raises:
        ValueError: pads and images that differ in count (pad text in the data, or a tokenizer that splits the pad).
    """
    expanded, expanded_labels, seen = array("i"), array("i"), 0
    for token, label in zip(tokens, labels):
        if token != vision_tokens.pad:
            expanded.append(token)
            expanded_labels.append(label)
            continue
        if seen == len(images):
            raise ValueError(f"{where}: the text itself holds {IMAGE_PAD}; write images with {IMAGE_MARKER} markers")
        n = processor.tokens(images[seen].grid)
        expanded.extend([token] * n)
        expanded_labels.extend([IGNORE_INDEX] * (n - 1) + [label])
        seen += 1
    if seen != len(images):
        raise ValueError(
            f"{where}: the tokenizer wrote {seen} {IMAGE_PAD} token(s) for {len(images)} image(s); its chat "
            f"template or vocabulary does not keep {IMAGE_PAD} as one token"
        )
    return expanded, expanded_labels


def build_image_example(
    row: Mapping[str, Any],
    chat: ChatTokenizer,
    processor: ImageProcessor,
    vision_tokens: VisionTokens,
    *,
    loss_on: LossOn,
    seq_len: int,
    columns: ColumnMap = ColumnMap(),  # noqa: B008 (frozen)
    base: str = ".",
    where: str = "<data>",
) -> ImageExample:
    """One row -> its ``ImageExample``.

    Raises:
        ValueError: one line naming ``where``: markers and images that differ in count, a missing or unreadable
            image, an example with images longer than ``seq_len`` (it cannot be cut through an image), the text
            row's own errors (``build_example``).
    """
    messages, markers = _messages(row, columns, where)
    paths = _image_paths(row, columns, base, where)
    if markers != len(paths):
        raise ValueError(
            f"{where}: {len(paths)} image(s) in '{columns.images}' but {markers} image marker(s) in the messages; "
            f"put one {IMAGE_MARKER} (or a {{'type': 'image'}} part) per image, in the images' order"
        )
    images = tuple(processor.info(p, where) for p in paths)
    tokens, labels = build_example({columns.messages: messages}, chat, loss_on=loss_on, columns=columns, source=where)
    expanded, expanded_labels = expand_image_pads(tokens, labels, images, processor, vision_tokens, where)
    if images and len(expanded) > seq_len:
        counts = [processor.tokens(i.grid) for i in images]
        raise ValueError(
            f"{where}: {len(expanded)} tokens with its images ({counts} image tokens) do not fit training.seq_len = "
            f"{seq_len}, and an image cannot be cut; raise seq_len, or lower max_pixels in the tokenizer folder's "
            "preprocessor_config.json (fewer tokens per image)"
        )
    return ImageExample(expanded, expanded_labels, images)
