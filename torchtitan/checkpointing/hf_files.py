"""Reading a Hugging Face model folder's files (config.json, the safetensors index): light, so the
pre-launch checks use it without the conversion machinery (hf.py)."""

from __future__ import annotations

import json
import os
from typing import Any

from safetensors import safe_open


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    """An HF model folder's ``config.json``.

    Raises:
        ValueError: no such folder, or no ``config.json`` in it.
    """
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        what = "has no config.json" if os.path.isdir(hf_dir) else "does not exist"
        raise ValueError(
            f"Hugging Face folder {hf_dir!r} {what}; pass a folder written by save_pretrained "
            f"(config.json + *.safetensors)"
        )
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def hf_weight_files(hf_dir: str) -> dict[str, str]:
    """Every weight of an HF folder -> the safetensors file holding it (index file or all ``*.safetensors``).

    Raises:
        ValueError: no safetensors files (a PyTorch ``.bin`` checkpoint is not read: re-save it with
            ``save_pretrained(..., safe_serialization=True)``).
    """
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return {k: os.path.join(hf_dir, v) for k, v in json.load(f)["weight_map"].items()}
    names = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(
            f"Hugging Face folder {hf_dir!r} has no *.safetensors files; re-save the model with "
            f"save_pretrained(..., safe_serialization=True)"
        )
    files = {}
    for name in names:
        with safe_open(os.path.join(hf_dir, name), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), os.path.join(hf_dir, name)))
    return files
