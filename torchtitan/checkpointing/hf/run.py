"""A training run's Hugging Face ends: start from an HF folder (``checkpoint.initial_load_path`` with
``initial_load_in_hf``, sharded per rank) or a checkpoint's weights, and export the last checkpoint
(``checkpoint.last_save_in_hf``); their pre-launch checks. File conversions are hf.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import torchtitan.checkpointing.files.integrity as integrity
from torchtitan.checkpointing.common import agree, one_process_quiet, read_metadata, short_error
from torchtitan.checkpointing.compat import check_model_matches
from torchtitan.checkpointing.files.folders import CheckpointInfo, verify_files
from torchtitan.checkpointing.files.format import check_readable
from torchtitan.checkpointing.files.marker import SEED, read_marker, why_not_loadable
from torchtitan.checkpointing.hf.convert import adapter_of, check_hf_matches, export_to_hf
from torchtitan.checkpointing.hf.files import hf_weight_files, open_safetensors
from torchtitan.dtypes import to_dtype

if TYPE_CHECKING:
    from torchtitan.config.schema import Checkpoint as CheckpointConfig

logger = logging.getLogger(__name__)


def load_hf_into(
    view: nn.Module, hf_dir: str, model_name: str, args: dict[str, Any], keys: Callable[[str], bool] | None = None
) -> int:
    """Replace the (parallelized) model's weights with an HF folder's; returns the count loaded.

    Sharded: weights are read one layer at a time (plus the embedding, final norm and head), converted
    with the family's adapter, and each rank keeps only the slice its DTensor shard (FSDP, TP, EP)
    holds; a pipeline stage reads only its own layers. So a rank holds at most one layer's whole
    weights beyond its own shards, never the whole model. Buffers the HF model does not have
    (e.g. the MoE expert bias) keep their initial values. Collective-free; every rank reads the files.
    ``keys``: the model keys an HF folder fills (a partial scope's base: its trained part keeps its init).

    Raises:
        ValueError: a weight of this model that the folder does not hold, or a shape that differs.
    """
    from torchtitan.checkpointing.state import ModelState

    check_hf_matches(hf_dir, model_name, args)
    adapter = adapter_of(model_name)
    model = ModelState(view, keys=keys)
    targets = model.state_dict()
    params = {name for name, _ in view.named_parameters(remove_duplicate=False)}
    files = hf_weight_files(hf_dir)
    groups: dict[str, list[str]] = {}
    for key in files:  # "model.layers.3.mlp..." (or "model.language_model.layers.3...") -> "3"; the rest -> ""
        groups.setdefault(_layer_of(key), []).append(key)
    ours_needed = {_hf_group_of(k, args) for k in targets}
    loaded: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def read(key: str) -> torch.Tensor:
            path = files[key]
            if path not in handles:
                handles[path] = stack.enter_context(open_safetensors(path))
            return handles[path].get_tensor(key)

        for group, keys in groups.items():
            if group not in ours_needed:
                continue  # another pipeline stage's layer
            converted = adapter.from_hf_state_dict({k: read(k) for k in keys}, args)
            for key, full in converted.items():
                if key in targets:
                    loaded[key] = local_slice(targets[key], full, key, hf_dir)
            del converted
    missing = sorted(k for k in targets if k not in loaded and k in params)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint.initial_load_path = {hf_dir!r} lacks weights of this model: {shown}")
    for key in targets:
        loaded.setdefault(key, targets[key])  # buffers HF does not store: as initialised
    model.load_state_dict(loaded)
    return len(loaded)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_of(key: str) -> str:
    """Our key's layer ("layers.3...", or "hf.model.layers.3..." for a transformers model), "" outside the layers."""
    found = _LAYER.search(key)
    return found.group(1) if found else ""


_MTP_DEPTH = re.compile(r"^mtp\.(\d+)\.")


def _hf_group_of(key: str, args: dict[str, Any]) -> str:
    """The HF layer group of our key: its layer, or for a multi-token-prediction depth k (``mtp.{k}.``, DeepSeek-V3's
    layout) the published layer ``n_layers + k``."""
    found = _MTP_DEPTH.match(key)
    return str(args["n_layers"] + int(found.group(1))) if found else _layer_of(key)


def local_slice(target: torch.Tensor, full: torch.Tensor, key: str, hf_dir: str) -> torch.Tensor:
    """``full`` (the whole weight) cut to ``target``'s shard, in its dtype, device and placements."""
    if tuple(full.shape) != tuple(target.shape):
        raise ValueError(
            f"checkpoint.initial_load_path = {hf_dir!r}: weight {key} has shape {tuple(full.shape)}, "
            f"the model's is {tuple(target.shape)}"
        )
    if not isinstance(target, DTensor):
        return full.to(dtype=target.dtype, device=target.device, copy=True)
    # The box DCP itself reads for this shard when it reshards (nested dim-0 sharding, FSDP over TP,
    # is a contiguous box too); cut on the host, so only the shard goes to the device.
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    piece = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    local = torch.empty(shape, dtype=target.dtype, device=target.to_local().device).copy_(piece)  # not a view
    return DTensor.from_local(
        local, target.device_mesh, target.placements, run_check=False, shape=target.shape, stride=target.stride()
    )


# How long the other ranks wait for rank 0's Hugging Face export (checkpoint.last_save_in_hf).
_HF_EXPORT_TIMEOUT_S = 4 * 3600


def initial_load(
    config: CheckpointConfig,
    view: nn.Module,
    model_info: dict[str, Any],
    targets: Callable,
    rank: int,
    pg: Any,
    base_keys: Callable[[str], bool] | None = None,
) -> str:
    """``checkpoint.initial_load_path``: the run's starting weights (model only), from a Hugging Face
    folder (``initial_load_in_hf``) or a complete checkpoint; returns what was loaded, for the summary.

    ``targets(info, metadata)``: the manager's DCP load targets (model only for a seed); ``base_keys``: the keys
    an HF folder fills (checkpointing/scope.py).
    """
    path = config.initial_load_path
    start = time.perf_counter()
    if config.initial_load_in_hf:
        load_hf_into(view, path, model_info["name"], model_info["args"], base_keys)
        what = "Hugging Face weights"
    else:

        def checked() -> CheckpointInfo:
            marker = read_marker(path)
            if marker is None:
                raise ValueError(f"checkpoint.initial_load_path = {path!r} {why_not_loadable(path)}")
            check_readable(marker, path)
            found = CheckpointInfo(marker.get("step", 0), path, marker)
            verify_files(found, checksums=config.verify_checksums)
            return found

        info = agree(checked)
        check_model_matches((info.marker or {}).get("model"), model_info, path)
        state = targets(dataclasses.replace(info, marker={**info.marker, "kind": SEED}), read_metadata(path))
        try:
            with one_process_quiet():
                integrity.load(state, path, process_group=pg, no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as e:
            raise ValueError(f"checkpoint.initial_load_path {path} could not be loaded: {short_error(e)}") from e
        what = "checkpoint weights (model only)"
    if rank == 0:
        logger.info("started from %s in %s in %.2f s", what, path, time.perf_counter() - start)
    return f"initial weights from {path}"


def export_last_in_hf(config: CheckpointConfig, path: str, out: str, export: Callable | None = None) -> None:
    """``checkpoint.last_save_in_hf``: rank 0 converts the complete checkpoint at ``path`` to ``out`` (with
    ``export``, a partial scope's export; default ``export_to_hf``); every rank learns how it went, so a failed
    export raises everywhere (the checkpoint is kept)."""

    def run_export() -> None:
        start = time.perf_counter()
        dtype = to_dtype(config.export_dtype) if config.model_weights_only else None
        try:
            (export or export_to_hf)(path, out, dtype)
        except Exception as e:  # reported on every rank, not only here
            raise ValueError(f"checkpoint.last_save_in_hf: exporting {path} to {out} failed: {short_error(e)}") from e
        logger.info("Hugging Face export written to %s in %.2f s", out, time.perf_counter() - start)

    if not dist.is_initialized():
        run_export()
        return
    # The conversion outlasts the training collectives' timeout on large models: the ranks wait on a
    # group of their own with a long one.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=_HF_EXPORT_TIMEOUT_S))
    try:
        agree(run_export, group=group)
    finally:
        dist.destroy_process_group(group)
