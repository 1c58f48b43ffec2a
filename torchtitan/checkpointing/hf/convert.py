"""Hugging Face export and import: files in, files out; the family's spec maps the weights.

``export_to_hf`` reads a complete checkpoint, finds its family from the marker, and writes
safetensors (one file, or shards with ``model.safetensors.index.json``) + ``config.json`` with
that family's ``state_dict_adapter``; ``import_from_hf`` does the reverse into a step-0 seed
checkpoint. Starting a run from an HF folder and exporting its last checkpoint: hf/run.py.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from torchtitan.checkpointing.common import (
    load_model_weights,
    save_model_weights,
)
from torchtitan.checkpointing.files.marker import read_marker
from torchtitan.checkpointing.hf.files import hf_folder_args, load_hf_weights, read_hf_config, save_hf_folder
from torchtitan.checkpointing.scope import partial_scope_of
from torchtitan.spec import (
    StateDictAdapter,
    get_model_spec,
    hf_conversion_refusal,
    spec_for_hf_model_type,
)

logger = logging.getLogger(__name__)


def adapter_of(model_name: str) -> StateDictAdapter:
    """The family's adapter, for an import (HF -> ours).

    Raises:
        NotImplementedError: the family has none (its one-line reason, ``hf_conversion_refusal``).
    """
    spec = get_model_spec(model_name)
    if spec.state_dict_adapter is None:
        raise NotImplementedError(hf_conversion_refusal(spec, {}, export=False))
    return spec.state_dict_adapter


def export_to_hf(checkpoint_path: str, output_dir: str, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Write ``model.safetensors`` + ``config.json`` for a complete checkpoint folder; returns the config.

    ``dtype`` defaults to the checkpoint's own (an export may be bf16/fp16). A checkpoint that holds part of a
    model (checkpointing/scope.py: LoRA's adapters) is its feature's to export (``scripts/convert_to_hf.py``).

    Raises:
        NotImplementedError: weights the family says have no HF counterpart (refused before any is read).
        ValueError: not a complete checkpoint of this trainer, or one of part of a model.
    """
    info = (read_marker(checkpoint_path) or {}).get("model") or {}
    spec = get_model_spec(info.get("name") or "llama3")
    why = hf_conversion_refusal(spec, info["args"]) if info.get("args") else None
    if why is not None:
        raise NotImplementedError(why)
    if (scope := partial_scope_of(info)) is not None:
        raise ValueError(
            f"{checkpoint_path} holds part of a model (its {scope} run's trained keys), not a whole one; convert it "
            "with scripts/convert_to_hf.py, which writes that feature's format"
        )
    weights, marker = load_model_weights(checkpoint_path)
    args = _marker_args(marker, checkpoint_path)
    adapter = spec.state_dict_adapter
    dtype = dtype or next(iter(weights.values())).dtype
    hf = {k: v.to(dtype) for k, v in adapter.to_hf_state_dict(weights, args).items()}
    config = adapter.hf_config(args, weights, dtype=dtype)
    del weights
    save_hf_folder(hf, config, output_dir)
    return config


def import_from_hf(hf_dir: str, output_path: str, model_name: str | None = None) -> None:
    """HF ``model.safetensors`` + ``config.json`` -> a step-0 seed checkpoint at ``output_path``.

    A run whose checkpoint folder holds it (as ``step-0``) starts from these weights; the model
    config must match (the load checks every key and shape). ``model_name``: the family; default
    the one whose ``hf_model_type`` is the config's ``model_type``.
    """
    hf_config = read_hf_config(hf_dir)
    if model_name is None:
        model_name = spec_for_hf_model_type(hf_config.get("model_type", "llama")).name
    args, weights = load_hf_weights(hf_dir, adapter_of(model_name))
    save_model_weights(weights, output_path, {"name": model_name, "flavor": None, "args": args, "source": hf_dir})


def _marker_args(marker: dict[str, Any], path: str) -> dict[str, Any]:
    args = (marker.get("model") or {}).get("args")
    if not args:
        raise ValueError(f"{path}: its marker records no model args; it was not written by this trainer")
    return args


def check_hf_matches(hf_dir: str, model_name: str, args: dict[str, Any]) -> None:
    """The HF folder holds this family at these shapes (before any weight is read).

    Raises:
        ValueError: another family (``model_type``), or model args that differ from the flavor's.
    """
    spec = get_model_spec(model_name)
    adapter = adapter_of(model_name)
    config = read_hf_config(hf_dir)
    if not spec.reads_hf_model_type(config.get("model_type")):
        raise ValueError(
            f"checkpoint.initial_load_path = {hf_dir!r} holds a {config.get('model_type')!r} model and "
            f"model.name = {model_name!r} reads {spec.hf_model_type!r}; set model.name to that family"
        )
    theirs = hf_folder_args(hf_dir, adapter)
    _check_at_most(hf_dir, args, theirs)
    differ = {
        k: (args[k], v)
        for k, v in theirs.items()
        if k in args and k not in (*_NOT_SHAPES, *_AT_MOST) and _as_plain(_kv(args, k)) != _as_plain(_kv(theirs, k))
    }
    if differ:
        listed = ", ".join(f"{k}: flavor {ours!r} vs checkpoint {hf!r}" for k, (ours, hf) in sorted(differ.items()))
        raise ValueError(
            f"checkpoint.initial_load_path = {hf_dir!r} does not match model.flavor ({listed}); pick the flavor "
            f"of that model's size (docs/models.md lists them)"
        )


# Args that size no weight: the run's seq_len sizes the RoPE cache, norm_type picks a kernel. Llama's FFN width is
# read from intermediate_size as multiple_of / ffn_dim_multiplier, which a flavor spells its own way (the weights'
# shapes are checked as they load). The ``hf`` family's ``config`` is the config.json text, which a saved folder
# spells with transformers' bookkeeping (its version, ``architectures``): the shapes read from it are compared.
_NOT_SHAPES = ("max_seq_len", "norm_type", "multiple_of", "ffn_dim_multiplier", "config")


# Args a run may take fewer of than the folder holds: DeepSeek-V3's multi-token-prediction layers (config.json's
# num_nextn_predict_layers) past the run's model.mtp_layers are not read.
_AT_MOST = {"mtp_layers": ("model.mtp_layers", "multi-token-prediction layers (config.json num_nextn_predict_layers)")}


def _check_at_most(hf_dir: str, args: dict[str, Any], theirs: dict[str, Any]) -> None:
    for k, (key, what) in _AT_MOST.items():
        if args.get(k, 0) > theirs.get(k, 0):
            raise ValueError(
                f"{key} = {args[k]} with checkpoint.initial_load_path = {hf_dir!r}, which holds {theirs.get(k, 0)} "
                f"{what}; allowed: 0..{theirs.get(k, 0)}; set {key} <= {theirs.get(k, 0)}"
            )


def _kv(args: dict[str, Any], key: str) -> Any:
    """``n_kv_heads`` None means one per query head."""
    return (args.get("n_kv_heads") or args["n_heads"]) if key == "n_kv_heads" else args[key]


def _as_plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda o: o.__dict__))
