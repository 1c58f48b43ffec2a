"""The ``[checkpoint]`` section of the config tree (torchtitan/config/schema.py holds the tree)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtitan.config.bounds import Bound
from torchtitan.config.fields import config_field as _f


@dataclass
class Checkpoint:
    enable_checkpoint: bool = _f(False, "save DCP checkpoints and resume from the newest complete one")
    folder: str = _f(
        "checkpoint",
        "checkpoint folder, relative to job.dump_folder; or a URL, used as it is: s3://bucket/prefix (pip install "
        "s3fs), gs://bucket/prefix (gcsfs), any fsspec protocol; credentials from the environment "
        "(docs/checkpoint.md, Remote storage)",
    )
    interval_type: Literal["steps", "seconds"] = _f("steps", "unit of `interval` (seconds: rank 0's clock decides)")
    interval: int = _f(500, "save every N steps or seconds", bound=Bound(ge=1, text=">= 1 ({interval_type})"))
    model_weights_only: bool = _f(False, "the final save holds the model weights only (an export, not a resume point)")
    export_dtype: Literal["float32", "bfloat16", "float16"] = _f("float32", "dtype of a weights-only export")
    create_seed_checkpoint: bool = _f(False, "initialise on one process, save step-0 (weights only) and exit")
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = _f(
        "disabled",
        "write checkpoints in a background thread (the final save is synchronous). async: the step waits while the "
        "state is copied to host memory; async_with_pinned_mem: the copy also runs in the background, into host "
        "buffers kept for the run (pinned with an accelerator, plain host memory on CPU), and the step waits for it "
        "only before the next optimizer update",
    )
    keep_latest_k: int = _f(
        0,
        "keep only the newest K complete full checkpoints (the step-0 seed and weights-only exports are kept); 0 = all",
        bound=Bound(ge=0, text=">= 0 (0 keeps every checkpoint)"),
    )
    load_step: int = _f(
        -1,
        "step to resume from; -1 = the newest complete checkpoint",
        bound=Bound(ge=-1, text="-1 (the newest complete checkpoint) or a step >= 0"),
    )
    verify_checksums: bool = _f(
        True,
        "before loading, compare every file's CRC32 with the one recorded when it was written (rank 0 reads the "
        "whole checkpoint once); false skips that for huge checkpoints (file sizes are still checked)",
    )
    initial_load_path: str = _f(
        "",
        "weights to start from when the checkpoint folder has nothing to resume: a complete step-N folder (DCP; "
        "model weights only; a URL too) or, with initial_load_in_hf, a local Hugging Face folder (config.json + "
        "*.safetensors)",
    )
    initial_load_in_hf: bool = _f(
        False,
        "initial_load_path is a Hugging Face folder: each rank reads only its shards, one layer at a time, "
        "through the family's adapter; model.flavor must match its config.json",
    )
    last_save_in_hf: bool = _f(
        False,
        "after the last step's checkpoint, also write the model in Hugging Face format (safetensors + config.json) "
        "to <dump_folder>/hf/step-N (rank 0 converts the saved checkpoint)",
    )
    exclude_from_loading: list[str] = _f(
        [],
        "parts of a full checkpoint not to restore on resume: any of optimizer, lr_scheduler, dataloader (they "
        "start fresh; the model weights, step and RNG are restored)",
    )
