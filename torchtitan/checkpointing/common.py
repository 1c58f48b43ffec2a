"""What the checkpoint manager and the conversions share: rank-0 decisions every rank learns, DCP
metadata reads, quiet one-process DCP calls, and whole-model weight files (seed checkpoints)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

import torchtitan.checkpointing.files.integrity as integrity
from torchtitan.checkpointing.files.folders import CheckpointInfo, list_files, verify_files
from torchtitan.checkpointing.files.format import check_readable
from torchtitan.checkpointing.files.marker import SEED, read_marker, why_not_loadable, write_marker
from torchtitan.checkpointing.files.storage import isdir, rmtree

if TYPE_CHECKING:
    from torchtitan.config.schema import Model


def agree(decide: Callable[[], Any], group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0 runs ``decide`` and every rank gets its result (or its ValueError, re-raised; an OSError, as a store's
    refusal to list a checkpoint folder, as a ValueError naming it), so no rank waits for an answer that never comes."""
    if not dist.is_initialized():
        return decide()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", decide())
        except ValueError as e:
            box[0] = ("error", str(e))
        except OSError as e:
            box[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0, group=group)
    status, value = box[0]
    if status == "error":
        raise ValueError(value)
    return value


@contextmanager
def one_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns on every call that it assumes one process: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def read_metadata(path: str) -> Any:
    try:
        return integrity.read_metadata_file(os.path.join(path, ".metadata"))
    except integrity.ForeignPickleError:
        raise  # already one clear line naming the file and the foreign type
    except Exception as e:
        raise ValueError(f"checkpoint {path}: cannot read its DCP metadata ({type(e).__name__}: {e})") from e


def short_error(e: BaseException) -> str:
    """One line per failing rank instead of DCP's per-rank tracebacks."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in e.failures.items())
    return f"{type(e).__name__}: {e}"


def model_info(*, model: Model, model_args: Any) -> dict[str, Any]:
    """What a marker records about the model (read by the conversion scripts); a partial scope adds its own record
    (checkpointing/scope.py)."""
    return {"name": model.name, "flavor": model.flavor, "args": dataclasses.asdict(model_args)}


def save_model_weights(state_dict: dict[str, torch.Tensor], path: str, info: dict[str, Any]) -> None:
    """One process: write whole-model weights as a complete step-0 seed checkpoint at ``path``."""
    if isdir(path):
        rmtree(path)
    with one_process_quiet():
        integrity.save({"model": state_dict}, path, no_dist=True)
    write_marker(path, 0, SEED, model=info, files=list_files(path))  # sizes, and CRCs from the writer's sidecars


def load_model_weights(path: str, *, verify_checksums: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One process, no process group: a checkpoint's whole-model weights as plain tensors, and its marker.

    Raises:
        ValueError: ``path`` does not exist or is not a complete checkpoint, is corrupted (``verify_files``; CRC32s with
            ``verify_checksums``) or holds a foreign pickle.
    """
    marker = read_marker(path)
    if marker is None:
        raise ValueError(f"{path} {why_not_loadable(path)}")
    check_readable(marker, path)
    verify_files(CheckpointInfo(marker.get("step", -1), path, marker), checksums=verify_checksums)
    metadata = read_metadata(path)
    weights = {
        key[len("model.") :]: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }
    with one_process_quiet():
        integrity.load({"model": weights}, path, no_dist=True)
    return weights, marker
