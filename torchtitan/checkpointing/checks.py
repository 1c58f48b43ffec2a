"""Pre-launch checks of the checkpoint keys (docs/checkpoint.md). Light: the preflight runs them
before every launch, so neither DCP nor the conversion machinery is imported here."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from torchtitan.checkpointing.hf_files import hf_weight_files, read_hf_config
from torchtitan.checkpointing.marker import read_marker, why_not_loadable
from torchtitan.config.errors import ConfigError
from torchtitan.spec import flavor_args, get_model_spec, hf_conversion_refusal

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.config.schema import Checkpoint, Model
    from torchtitan.distributed.parallel_dims import ParallelDims

EXCLUDABLE = ("optimizer", "lr_scheduler", "dataloader")


def check_checkpoint(config: JobConfig, dims: ParallelDims) -> list[str]:
    """The checkpoint keys' combinations (their ranges are schema bounds); warnings for keys with no effect."""
    ck = config.checkpoint
    for part in ck.exclude_from_loading:
        if part not in EXCLUDABLE:
            raise ConfigError(
                f"checkpoint.exclude_from_loading = {ck.exclude_from_loading}: {part!r} cannot be excluded; allowed "
                f"are {list(EXCLUDABLE)} (the model weights are what a resume loads; the step and RNG follow them)"
            )
    _check_hf_keys(ck, model=config.model)
    if ck.create_seed_checkpoint and dims.world_size != 1:
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint = true needs one process (it initialises the whole model and "
            f"exits), got world_size {dims.world_size}; run scripts/create_seed_checkpoint.sh"
        )
    if ck.async_mode == "async_with_pinned_mem":
        raise NotImplementedError("checkpoint.async_mode = 'async_with_pinned_mem' is not built yet; use 'async'")
    return _warnings(ck)


def check_pinned_memory_device(config: JobConfig, dims: ParallelDims, device_type: str) -> list[str]:
    """On ``device_type``: pinned host memory only speeds device-to-host copies (refused on CPU for that reason,
    before check_checkpoint's "not built yet")."""
    if config.checkpoint.async_mode == "async_with_pinned_mem" and device_type == "cpu":
        raise ConfigError(
            "checkpoint.async_mode = 'async_with_pinned_mem' stages into pinned memory for fast GPU-to-host "
            "copies, and the run trains on 'cpu': no GPU; use 'async' (the state is already in host memory)"
        )
    return []


def _warnings(ck: Checkpoint) -> list[str]:
    out = []
    no_effect = ck.async_mode != "disabled" or ck.keep_latest_k or ck.load_step != -1
    no_effect = no_effect or ck.model_weights_only or ck.exclude_from_loading
    if not ck.enable_checkpoint and not ck.create_seed_checkpoint and no_effect:
        out.append(
            "checkpoint.async_mode / keep_latest_k / load_step / model_weights_only / exclude_from_loading have no "
            "effect without checkpoint.enable_checkpoint = true"
        )
    if ck.export_dtype != "float32" and not ck.model_weights_only:
        out.append("checkpoint.export_dtype has no effect without checkpoint.model_weights_only = true")
    return out


def _check_hf_keys(ck: Checkpoint, *, model: Model) -> None:
    """The Hugging Face checkpoint keys' combinations (no file is read).

    Raises:
        ConfigError: ``initial_load_in_hf`` without a path, ``last_save_in_hf`` without checkpointing.
        NotImplementedError: weights the family says have no HF counterpart (its spec's ``hf_refusal``).
    """
    if ck.initial_load_in_hf and not ck.initial_load_path:
        raise ConfigError(
            "checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path (the Hugging Face folder to start from)"
        )
    if ck.last_save_in_hf and not ck.enable_checkpoint:
        raise ConfigError(
            "checkpoint.last_save_in_hf = true converts the last step's checkpoint, and checkpoint.enable_checkpoint "
            "is false; set it to true"
        )
    for key, export in (("initial_load_in_hf", False), ("last_save_in_hf", True)):
        if getattr(ck, key):
            args = dataclasses.asdict(flavor_args(model))
            why = hf_conversion_refusal(get_model_spec(model.name), args, export=export)
            if why is not None:
                raise NotImplementedError(f"checkpoint.{key} = true: {why}")


def check_initial_load(config: JobConfig, dims: ParallelDims) -> list[str]:
    """This machine: ``checkpoint.initial_load_path`` is what ``initial_load_in_hf`` says it is.

    Raises:
        ConfigError: another family's HF folder, or a folder that does not exist or is not a complete checkpoint.
        ValueError: an HF folder without config.json or safetensors.
    """
    ck = config.checkpoint
    path = ck.initial_load_path
    if not path:
        return []
    if ck.initial_load_in_hf:
        _check_hf_keys(ck, model=config.model)  # a family with no conversion: its reason, before any file is read
        hf = read_hf_config(path)
        hf_weight_files(path)
        want = get_model_spec(config.model.name).hf_model_type
        if hf.get("model_type") != want:
            raise ConfigError(
                f"checkpoint.initial_load_path = '{path}' holds a {hf.get('model_type')!r} model and model.name = "
                f"{config.model.name!r} reads {want!r}; set model.name to that model's family"
            )
    elif read_marker(path) is None:
        why = why_not_loadable(path)
        if os.path.isfile(os.path.join(path, "config.json")):
            why = "is not a complete checkpoint; it looks like a Hugging Face folder: set checkpoint.initial_load_in_hf = true"
        raise ConfigError(f"checkpoint.initial_load_path = '{path}' {why}")
    return []
