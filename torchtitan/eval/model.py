"""The model an evaluation runs: built from a training config (its flavor, tokenizer and layout), its weights
from one of our DCP checkpoints or a Hugging Face folder (through the family's adapter).

The layout is the config's: ``training.data_parallel_shard_degree`` (FSDP2) and ``training.tensor_parallel_degree``
over the processes torchrun starts, built by the trainer's own ``build_model``. Pipeline and context parallel are
refused (an evaluation forward is one whole sequence through one model).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchtitan.config.manager import JobConfig
from torchtitan.distributed.mesh import WorldMesh
from torchtitan.distributed.parallel_dims import ParallelDims


@dataclass(frozen=True)
class EvalModel:
    """What an evaluation needs of a model: the module (eval mode), its tokenizer, the layout it runs under
    and the longest sequence its RoPE table holds."""

    model: nn.Module
    tokenizer: Any
    world: WorldMesh
    device: torch.device
    max_seq_len: int
    amp_dtype: torch.dtype | None = None
    forwards: Callable[[], AbstractContextManager] = nullcontext
    """What every forward runs inside (the trainer's block_causal feed: plain causal attention per request)."""


def load_config(config: str | JobConfig, overrides: list[str] | None = None, *, module: str | None = None) -> JobConfig:
    """A JobConfig from a TOML file, or from function ``config`` of ``module`` (``--module M --config F``), and
    ``--section.key value`` overrides; or the one given."""
    if isinstance(config, JobConfig):
        return config
    if module is not None:
        return JobConfig.parse_args(["--module", module, "--config", config, *(overrides or [])])
    if not os.path.isfile(config):
        raise FileNotFoundError(f"config={config!r}: no such TOML file; pass the training config of the checkpoint")
    return JobConfig.parse_args(["--job.config_file", config, *(overrides or [])])


def build_eval_model(
    config: JobConfig, *, checkpoint: str | None = None, hf: str | None = None, tokenizer_from_config: bool = False
) -> EvalModel:
    """The config's model under its layout on this process, with the weights of ``checkpoint`` (a complete
    ``step-N`` folder: the tokenizer its run trained with, which its marker records, unless
    ``tokenizer_from_config``) or ``hf`` (a Hugging Face folder: its own tokenizer when it holds one, else the
    config's, and its embedding rows, which may be padded past the tokenizer); neither: the seeded initialisation.

    Raises:
        ValueError: a checkpoint of another family or flavor than the config's, or a tokenizer of another
            vocabulary.
        NotImplementedError: pipeline or context parallel in the config.
    """
    from torchtitan.build import autocast_dtype, build_model, build_model_args
    from torchtitan.checkpointing.hf.files import hf_embedding_rows
    from torchtitan.datasets.tokenizer import build_tokenizer
    from torchtitan.distributed.backend.device import get_device_info, init_distributed
    from torchtitan.spec import get_model_spec

    if checkpoint and hf:
        raise ValueError("give checkpoint=STEP_FOLDER or hf=HF_FOLDER, not both")
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world_size)
    if dims.pp > 1 or dims.cp > 1:
        raise NotImplementedError(
            f"evaluation under pipeline_parallel_degree = {dims.pp}, context_parallel_degree = {dims.cp}: only FSDP2 "
            "and tensor parallel layouts evaluate; set both to 1 in the evaluation's config"
        )
    info = get_device_info()
    if world_size > 1 and not dist.is_initialized():
        init_distributed(info, config.comm.init_timeout_seconds, 0)
    spec = get_model_spec(config.model.name)
    tokenizer_path = _tokenizer_path(config, checkpoint if not tokenizer_from_config else None, hf)
    tokenizer = build_tokenizer(tokenizer_path)
    vocab = hf_embedding_rows(hf, tokenizer.n_words, tokenizer_path) if hf else tokenizer.n_words
    args = build_model_args(config, spec, vocab, device_type=info.device.type)
    weights = None
    if checkpoint:
        weights = _checkpoint_weights(checkpoint, config, args)
    elif hf:
        weights = _hf_weights(hf, spec, args)
    mesh = dims.build_mesh(info.device.type) if world_size > 1 else None
    # activation checkpointing saves memory for a backward an evaluation never runs: built without it (a copy
    # of the config; the user's is not changed)
    inference = dataclasses.replace(
        config, activation_checkpoint=dataclasses.replace(config.activation_checkpoint, mode="none")
    )
    model = build_model(inference, args, dims, mesh, info.device)
    if weights is not None:
        _load(model, weights, source=checkpoint or hf)
    amp = autocast_dtype(config.training, dims)
    return EvalModel(model.eval(), tokenizer, WorldMesh(dims, mesh), info.device, args.max_seq_len, amp)


def _tokenizer_path(config: JobConfig, checkpoint: str | None, hf: str | None) -> str:
    """The tokenizer a checkpoint's run trained with (its marker's record), an HF folder's own, else the config's.

    Raises:
        FileNotFoundError: the recorded tokenizer is not on this machine.
    """
    from torchtitan.checkpointing.files.marker import recorded_tokenizer
    from torchtitan.checkpointing.hf.files import hf_folder_tokenizer

    fix = "pass overrides=--model.tokenizer_path <the same tokenizer's file or folder>"
    recorded = recorded_tokenizer(checkpoint, fix=fix) if checkpoint else None
    return recorded or (hf_folder_tokenizer(hf) if hf else None) or config.model.tokenizer_path


def _describe(info: dict[str, Any]) -> str:
    args = info.get("args") or {}
    shape = ", ".join(f"{k} {args[k]}" for k in ("dim", "n_layers", "n_heads", "vocab_size") if k in args)
    return f"{info.get('name')} {info.get('flavor')!r} ({shape})"


def _checkpoint_weights(path: str, config: JobConfig, args: Any) -> dict[str, torch.Tensor]:
    """The whole-model weights of a complete checkpoint, after checking it holds the config's family and flavor."""
    from torchtitan.checkpointing.common import load_model_weights
    from torchtitan.checkpointing.files.marker import read_marker, why_not_loadable

    marker = read_marker(path)
    if marker is None:
        raise ValueError(f"checkpoint={path}: {why_not_loadable(path)}")
    info = marker.get("model") or {}
    want = {"name": config.model.name, "flavor": config.model.flavor, "args": dataclasses.asdict(args)}
    saved = info.get("args") or {}
    differs = [
        k for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size") if saved.get(k) != want["args"].get(k)
    ]
    if info.get("name") != config.model.name or info.get("flavor") != config.model.flavor or differs:
        raise ValueError(
            f"checkpoint={path} holds {_describe(info)} but the config builds {_describe(want)}; pass the config "
            f"the checkpoint was trained with (or --model.flavor {info.get('flavor')})"
        )
    weights, _ = load_model_weights(path)
    return weights


def _hf_weights(folder: str, spec: Any, args: Any) -> dict[str, torch.Tensor]:
    """A Hugging Face folder's weights in our names (the family's adapter), checked against the config's shapes."""
    from torchtitan.checkpointing.hf.files import load_hf_weights

    if spec.state_dict_adapter is None:
        raise NotImplementedError(f"hf={folder}: model family {spec.name} has no Hugging Face adapter")
    fields, weights = load_hf_weights(folder, spec.state_dict_adapter)
    want = dataclasses.asdict(args)
    differs = [
        f"{k} {fields[k]} != {want[k]}"
        for k in ("dim", "n_layers", "n_heads", "vocab_size")
        if fields.get(k) != want.get(k)
    ]
    if differs:
        raise ValueError(
            f"hf={folder} does not match the config's {spec.name} flavor: {'; '.join(differs)}; pass the config "
            "whose flavor (and tokenizer) the folder was made from"
        )
    return weights


def _load(model: nn.Module, weights: dict[str, torch.Tensor], *, source: str) -> None:
    """Every weight into the (possibly sharded) model; a missing or extra key is an error, not skipped."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    own = model.state_dict()
    missing, extra = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or extra:
        raise ValueError(f"{source}: weights do not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    for key, tensor in own.items():
        if tuple(tensor.shape) != tuple(weights[key].shape):
            raise ValueError(
                f"{source}: {key} has shape {tuple(weights[key].shape)}, the config's model {tuple(tensor.shape)}; "
                "pass the config the weights were trained with"
            )
    weights = {k: v.to(own[k].dtype) for k, v in weights.items()}
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=True))
