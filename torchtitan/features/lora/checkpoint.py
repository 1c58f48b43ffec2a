"""LoRA's checkpoint scope (checkpointing/scope.py): a LoRA run's checkpoints hold its adapters, its frozen base is
re-read from ``checkpoint.initial_load_path`` (or drawn from the seed) on every start, every marker records the
adapters' settings and where the base came from, and a fresh start takes ``lora.adapter_path`` (a PEFT folder)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torch import nn

from torchtitan.checkpointing.hf.run import local_slice
from torchtitan.checkpointing.scope import ModelScope
from torchtitan.features.lora.hf_export import export_lora
from torchtitan.features.lora.linear import is_adapter_key, is_base_key
from torchtitan.features.lora.peft_io import check_peft_fits, read_peft_folder
from torchtitan.spec import get_model_spec

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.config.sections.lora import Lora


def build_scope(config: JobConfig) -> ModelScope:
    """The ``checkpoint_scope`` seam of a run with ``lora.enable`` (features/registry.py)."""
    lora, checkpoint = config.lora, config.checkpoint
    base = checkpoint.initial_load_path or None
    record = {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "base": os.path.abspath(base) if base else None,
        "base_in_hf": bool(base and checkpoint.initial_load_in_hf),
    }
    if lora.quantize_base != "none":  # QLoRA: merges dequantize the base they read (hf_export.merged_weights)
        record["quantize_base"] = lora.quantize_base
    return ModelScope(
        name="lora",
        saved=is_adapter_key,
        base=is_base_key,
        record=record,
        fresh_start=(lambda view, info: load_peft_into(view, lora, info)) if lora.adapter_path else None,
        export_hf=lambda path, out, dtype: export_lora(path, out, merge=False, dtype=dtype),
    )


def load_peft_into(view: nn.Module, lora: Lora, model_info: dict[str, Any]) -> str:
    """``lora.adapter_path`` (a PEFT folder) into the (parallelized) model's adapters, each rank its shards;
    returns what was loaded, for the summary.

    Raises:
        FileNotFoundError / ValueError: not a PEFT LoRA folder; another rank, alpha, targets or base model.
    """
    from torchtitan.checkpointing.state import ModelState

    spec, args = get_model_spec(model_info["name"]), model_info["args"]
    config, adapters = read_peft_folder(lora.adapter_path, spec, args)
    state = ModelState(view, keys=is_adapter_key)
    targets = state.state_dict()
    check_peft_fits(config, adapters, targets, lora.adapter_path, lora)
    state.load_state_dict({k: local_slice(t, adapters[k], k, lora.adapter_path) for k, t in targets.items()})
    return f"adapters from the PEFT folder {lora.adapter_path}"
