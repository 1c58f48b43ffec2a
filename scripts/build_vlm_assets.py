"""Build the synthetic image-question task ("shapes") for image-text fine-tuning, with its own tokenizer.

Writes, under ``--output``:

- ``images/*.png``: 48x48 pictures of one coloured shape (square, circle or triangle; red, green, blue or
  yellow) at a random place and size on a light background;
- ``shapes_train.jsonl`` / ``shapes_val.jsonl``: chat rows ``{"messages": [...], "images": [...]}`` asking
  "What colour is the shape?" or "What shape is it?" about one image (answered with one word), and, in about one
  train row in ten, "What colour is the second shape?" about two images. Validation images are drawn apart from
  the training ones (same kinds, new places and sizes); chance is 1/4 for a colour, 1/3 for a shape;
- ``tokenizer/``: a byte-level BPE trained on the task's text, special tokens ``<|endoftext|>`` (0, pad),
  ``<|im_start|>`` (1), ``<|im_end|>`` (2, eos), ``<|vision_start|>`` (3), ``<|image_pad|>`` (4),
  ``<|vision_end|>`` (5): the ids of the ``debugmodel`` flavors of ``qwen3_5_vl``; a ChatML template; and a
  ``preprocessor_config.json`` that sizes every image to 48x48 pixels (36 patches of 8, 9 image tokens).

Deterministic for a seed; only the stdlib, Pillow and ``tokenizers``. Tests and ``bench/vlm_shapes.py`` build it
into a temporary folder (``build``).

Usage:
    python scripts/build_vlm_assets.py --output /tmp/vlm_shapes [--train 600] [--val 120] [--seed 60]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import tokenizers
from PIL import Image, ImageDraw
from tokenizers import decoders, models, pre_tokenizers, trainers

SIDE = 48
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 220), "yellow": (230, 200, 40)}
SHAPES = ("square", "circle", "triangle")
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is it?"}
SECOND = "What colour is the second shape?"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def draw(rng: random.Random, shape: str, colour: str) -> Image.Image:
    """One picture: ``shape`` in ``colour``, 14-30 pixels wide, anywhere inside the frame."""
    background = tuple(rng.randint(225, 255) for _ in range(3))
    img = Image.new("RGB", (SIDE, SIDE), background)
    size = rng.randint(14, 30)
    x, y = rng.randint(2, SIDE - size - 2), rng.randint(2, SIDE - size - 2)
    box, fill = (x, y, x + size, y + size), COLOURS[colour]
    pen = ImageDraw.Draw(img)
    if shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "circle":
        pen.ellipse(box, fill=fill)
    else:
        pen.polygon([(x + size / 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return img


def _image(rng: random.Random, folder: Path, name: str) -> tuple[str, str, str]:
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    draw(rng, shape, colour).save(folder / "images" / f"{name}.png")
    return f"images/{name}.png", shape, colour


def _row(rng: random.Random, folder: Path, name: str, two: bool) -> dict:
    if two:
        first, (path, _, colour) = _image(rng, folder, f"{name}a"), _image(rng, folder, f"{name}b")
        text, answer, images = "<image><image>" + SECOND, colour, [first[0], path]
    else:
        path, shape, colour = _image(rng, folder, name)
        kind = rng.choice(list(QUESTIONS))
        text, answer, images = "<image>" + QUESTIONS[kind], colour if kind == "colour" else shape, [path]
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "images": images}


def train_tokenizer() -> tokenizers.Tokenizer:
    texts = [*QUESTIONS.values(), SECOND, *COLOURS, *SHAPES, "user\nassistant\n"]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts * 4, trainer=trainer)
    short = -tok.get_vocab_size(with_added_tokens=True) % 16  # a multiple of 16 (tensor parallel shards the vocab)
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    return tok


def build(output: str, *, train: int = 600, val: int = 120, seed: int = 60) -> Path:
    """Write the task under ``output``; returns the folder."""
    folder = Path(output)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer").mkdir(exist_ok=True)
    rng = random.Random(seed)
    rows = {
        "shapes_train.jsonl": [_row(rng, folder, f"t{i}", rng.random() < 0.1) for i in range(train)],
        "shapes_val.jsonl": [_row(rng, folder, f"v{i}", False) for i in range(val)],
    }
    for name, items in rows.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in items), encoding="utf-8")
    train_tokenizer().save(str(folder / "tokenizer" / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    processor = {
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
        "size": {"shortest_edge": SIDE**2, "longest_edge": SIDE**2},
    }
    (folder / "tokenizer" / "preprocessor_config.json").write_text(json.dumps(processor, indent=2), encoding="utf-8")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--train", type=int, default=600)
    parser.add_argument("--val", type=int, default=120)
    parser.add_argument("--seed", type=int, default=60)
    args = parser.parse_args()
    print(build(args.output, train=args.train, val=args.val, seed=args.seed))


if __name__ == "__main__":
    main()
