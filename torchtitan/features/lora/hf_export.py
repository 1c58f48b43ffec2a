"""A LoRA run's Hugging Face ends: its checkpoint as a PEFT adapter folder, or merged into its base as a full
HF model (``scripts/convert_to_hf.py --merge_lora``); a PEFT folder into a run's adapters (``lora.adapter_path``:
checkpoint.py). The PEFT format itself: lora/peft_io.py."""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.checkpointing.common import load_model_weights
from torchtitan.checkpointing.hf.files import hf_weight_files, read_safetensors, save_hf_folder
from torchtitan.features.lora.linear import is_adapter_key, is_base_key
from torchtitan.features.lora.peft_io import (
    adapter_config,
    merge_adapters,
    save_peft_folder,
)
from torchtitan.spec import get_model_spec


def export_lora(checkpoint_path: str, output_dir: str, *, merge: bool, dtype: torch.dtype | None) -> dict[str, Any]:
    """A LoRA checkpoint -> a PEFT folder (default) or, with ``merge``, its base with the adapters folded in as a
    full HF model; returns the written config (``adapter_config.json`` or ``config.json``).

    Raises:
        ValueError: ``merge`` without a recorded base (the run's base was its seeded init).
    """
    weights, marker = load_model_weights(checkpoint_path)
    info = marker["model"]
    lora, args, spec = info["lora"], info["args"], get_model_spec(info["name"])
    adapters = {k: v for k, v in weights.items() if is_adapter_key(k)}
    dtype = dtype or next(iter(adapters.values())).dtype
    if not merge:
        config = adapter_config(lora, spec, lora["base"], adapters)
        save_peft_folder({k: v.to(dtype) for k, v in adapters.items()}, config, output_dir, spec, args)
        return config
    merged = merged_weights(adapters, info, checkpoint_path)
    hf = {k: v.to(dtype) for k, v in spec.state_dict_adapter.to_hf_state_dict(merged, args).items()}
    config = spec.state_dict_adapter.hf_config(args, merged, dtype=dtype)
    save_hf_folder(hf, config, output_dir)
    return config


def merged_weights(adapters: dict[str, torch.Tensor], info: dict[str, Any], checkpoint_path: str) -> dict:
    """A LoRA checkpoint's adapters merged into the base its marker ``info`` records; for a QLoRA run
    (``quantize_base = 'nf4'``) into that base's adapted weights quantized to NF4 and dequantized, the base it trained on.

    Raises:
        ValueError: the run's base was its seeded init (not saved anywhere).
    """
    lora = info["lora"]
    if not lora.get("base"):
        raise ValueError(
            f"{checkpoint_path}: its LoRA run started its frozen base from the seed (no checkpoint.initial_load_path), "
            "which is not saved, so there is nothing to merge into; train from a seed checkpoint or an HF base, or "
            "export the PEFT adapter (scripts/convert_to_hf.py without --merge_lora)"
        )
    spec, args = get_model_spec(info["name"]), info["args"]
    base = read_base(lora["base"], lora["base_in_hf"], spec, args)
    if lora.get("quantize_base") == "nf4":
        from torchtitan.features.lora.quantize import nf4_round_trip

        targets = {k.removesuffix(".lora_a.weight") + ".weight" for k in adapters if k.endswith(".lora_a.weight")}
        base = {k: nf4_round_trip(v) if k in targets else v for k, v in base.items()}
    return merge_adapters(base, adapters, lora["alpha"] / lora["rank"])


def read_base(path: str, in_hf: bool, spec: Any, args: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The frozen base's whole weights (ours) from an HF folder or a complete checkpoint (its base keys)."""
    if in_hf:
        hf: dict[str, torch.Tensor] = {}
        for file in sorted(set(hf_weight_files(path).values())):
            hf.update(read_safetensors(file))
        return spec.state_dict_adapter.from_hf_state_dict(hf, args)
    weights, _ = load_model_weights(path)
    return {k: v for k, v in weights.items() if is_base_key(k)}
