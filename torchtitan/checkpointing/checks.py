"""Pre-launch checks of the checkpoint keys (docs/checkpoint.md). Light: the preflight runs them
before every launch, so neither DCP nor the conversion machinery is imported here."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from torchtitan.checkpointing.files.marker import read_marker, why_not_loadable
from torchtitan.checkpointing.files.storage import access_problem, is_url, missing_package
from torchtitan.checkpointing.hf.files import hf_weight_files, read_hf_config, vocab_rows
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
    _check_url_keys(config)
    if ck.create_seed_checkpoint and dims.world_size != 1:
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint = true needs one process (it initialises the whole model and "
            f"exits), got world_size {dims.world_size}; run scripts/create_seed_checkpoint.sh"
        )
    return _warnings(ck)


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
    if is_url(path):
        _check_url_keys(config)  # an HF folder from a URL: refused before the store is asked
        _check_store("checkpoint.initial_load_path", path, write=False)
    if ck.initial_load_in_hf:
        _check_hf_keys(ck, model=config.model)  # a family with no conversion: its reason, before any file is read
        hf = read_hf_config(path)
        hf_weight_files(path)
        spec = get_model_spec(config.model.name)
        if not spec.reads_hf_model_type(hf.get("model_type")):
            raise ConfigError(
                f"checkpoint.initial_load_path = '{path}' holds a {hf.get('model_type')!r} model and model.name = "
                f"{config.model.name!r} reads {spec.hf_model_type!r}; set model.name to that model's family"
            )
    elif read_marker(path) is None:
        why = why_not_loadable(path)
        if os.path.isfile(os.path.join(path, "config.json")):
            why = "is not a complete checkpoint; it looks like a Hugging Face folder: set checkpoint.initial_load_in_hf = true"
        raise ConfigError(f"checkpoint.initial_load_path = '{path}' {why}")
    return []


def check_vocabulary(config: JobConfig, dims: ParallelDims) -> list[str]:
    """This machine: the model's embedding rows against the tokenizer's words, by the rule the ranks build with
    (hf/files.py ``vocab_rows``): a model config naming fewer rows than the tokenizer has words is refused here, in one
    line, not on every rank.

    Raises:
        ValueError: see ``vocab_rows``; a tokenizer file that does not parse (``build_tokenizer``).
    """
    from torchtitan.datasets.tokenizer import build_tokenizer

    vocab_rows(config, get_model_spec(config.model.name), build_tokenizer(config.model.tokenizer_path).n_words)
    return []


def _check_url_keys(config: JobConfig) -> None:
    """Which keys may be URLs (docs/checkpoint.md, "Remote storage"): checkpoint.folder and initial_load_path.

    Raises:
        ConfigError: a URL job.dump_folder (the run's own files are local).
        NotImplementedError: a URL initial_load_path with initial_load_in_hf (an HF folder is read from local files).
    """
    dump, ck = config.job.dump_folder, config.checkpoint
    if "://" in dump:
        raise ConfigError(
            f"job.dump_folder = '{dump}' is a URL, and a run writes its own files there locally (metrics.jsonl, "
            "config.toml, run.lock, traces); set it to a local folder, and checkpoint.folder to a URL to keep the "
            f"checkpoints in a store (e.g. checkpoint.folder = '{dump.rstrip('/')}/checkpoint')"
        )
    if ck.initial_load_in_hf and is_url(ck.initial_load_path):
        raise NotImplementedError(
            f"checkpoint.initial_load_path = '{ck.initial_load_path}' with checkpoint.initial_load_in_hf = true: a "
            "Hugging Face folder is read from local files (its safetensors are memory-mapped); copy it to a local "
            "folder and pass that"
        )


def check_checkpoint_storage(config: JobConfig, dims: ParallelDims) -> list[str]:
    """This machine: a URL checkpoint.folder can be written (its fsspec package is installed, the store accepts the
    credentials, the bucket exists): a small object is written and deleted there, before any process group exists.

    Raises:
        ConfigError: naming the key, the URL and what the store answered (never the credentials).
    """
    ck = config.checkpoint
    if (ck.enable_checkpoint or ck.create_seed_checkpoint) and is_url(ck.folder):
        _check_store("checkpoint.folder", ck.folder, write=True)
    return []


def _check_store(key: str, url: str, *, write: bool) -> None:
    problem = missing_package(url) or access_problem(url, write=write)
    if problem is not None:
        raise ConfigError(f"{key} = '{url}' {problem}")
