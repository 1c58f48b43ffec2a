"""Checkpointing: DCP save/resume of the whole training state, seed checkpoints, weight export.

See docs/checkpoint.md for the layout on disk, the resume and resharding guarantees and integrity
(CRC32s taken while writing and checked on load; pickles restricted to DCP's types: integrity.py).
"""

from torchtitan.checkpointing.common import load_model_weights, model_info, save_model_weights
from torchtitan.checkpointing.folders import (
    EXPORT,
    FULL,
    MARKER,
    SEED,
    CheckpointInfo,
    SaveSchedule,
    find_resume_checkpoint,
    list_checkpoints,
    purge_stale,
    read_marker,
    step_folder,
    write_marker,
)
from torchtitan.checkpointing.manager import CheckpointManager, trim_metrics

__all__ = [
    "EXPORT",
    "FULL",
    "MARKER",
    "SEED",
    "CheckpointInfo",
    "CheckpointManager",
    "SaveSchedule",
    "find_resume_checkpoint",
    "list_checkpoints",
    "load_model_weights",
    "model_info",
    "purge_stale",
    "read_marker",
    "save_model_weights",
    "step_folder",
    "trim_metrics",
    "write_marker",
]
