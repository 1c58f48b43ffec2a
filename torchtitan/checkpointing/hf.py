"""Hugging Face export and import: files in, files out; the family's spec maps the weights.

``export_to_hf`` reads a complete checkpoint, finds its family from the marker, and writes
``model.safetensors`` + ``config.json`` with that family's ``state_dict_adapter``;
``import_from_hf`` does the reverse into a step-0 seed checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from torchtitan.checkpointing.manager import load_model_weights, save_model_weights
from torchtitan.spec import get_model_spec, spec_for_hf_model_type


def _adapter(model_name: str) -> Any:
    adapter = get_model_spec(model_name).state_dict_adapter
    if adapter is None:
        raise ValueError(f"model family {model_name!r} has no Hugging Face conversion (its spec's state_dict_adapter)")
    return adapter


def export_to_hf(checkpoint_path: str, output_dir: str, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Write ``model.safetensors`` + ``config.json`` for a complete checkpoint folder; returns the config.

    ``dtype`` defaults to the checkpoint's own (an export may be bf16/fp16).
    """
    weights, marker = load_model_weights(checkpoint_path)
    args = _marker_args(marker, checkpoint_path)
    adapter = _adapter((marker.get("model") or {}).get("name") or "llama3")
    dtype = dtype or next(iter(weights.values())).dtype
    hf = {k: v.to(dtype) for k, v in adapter.to_hf_state_dict(weights, args).items()}
    config = adapter.hf_config(args, weights, dtype=dtype)
    os.makedirs(output_dir, exist_ok=True)
    save_file(hf, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return config


def import_from_hf(hf_dir: str, output_path: str, model_name: str | None = None) -> None:
    """HF ``model.safetensors`` + ``config.json`` -> a step-0 seed checkpoint at ``output_path``.

    A run whose checkpoint folder holds it (as ``step-0``) starts from these weights; the model
    config must match (the load checks every key and shape). ``model_name``: the family; default
    the one whose ``hf_model_type`` is the config's ``model_type``.
    """
    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        hf_config = json.load(f)
    if model_name is None:
        model_name = spec_for_hf_model_type(hf_config.get("model_type", "llama")).name
    adapter = _adapter(model_name)
    args = adapter.model_args_from_hf(hf_config)
    weights = adapter.from_hf_state_dict(load_file(os.path.join(hf_dir, "model.safetensors")), args)
    save_model_weights(weights, output_path, {"name": model_name, "flavor": None, "args": args, "source": hf_dir})


def _marker_args(marker: dict[str, Any], path: str) -> dict[str, Any]:
    args = (marker.get("model") or {}).get("args")
    if not args:
        raise ValueError(f"{path}: its marker records no model args; it was not written by this trainer")
    return args
