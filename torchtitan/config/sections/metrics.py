"""The ``[metrics]`` section of the config tree (torchtitan/config/schema.py holds the tree).

What each key does: docs/metrics.md; the straggler detector: docs/reliability.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.config.bounds import Bound
from torchtitan.config.fields import POSITIVE as _POSITIVE
from torchtitan.config.fields import config_field as _f


@dataclass
class Metrics:
    log_freq: int = _f(10, "log metrics every N steps (each log syncs the device once)", bound=_POSITIVE)
    enable_tensorboard: bool = _f(False, "also write TensorBoard scalars")
    enable_color_printing: bool = _f(True, "colour the step log lines on a terminal")
    save_tb_folder: str = _f("tb", "TensorBoard folder, relative to job.dump_folder")
    rank_0_only: bool = _f(True, "only the logging rank writes metrics (the only mode supported)")
    enable_wandb: bool = _f(False, "also log to Weights & Biases (needs `pip install wandb`; WANDB_* env vars apply)")
    device_peak_flops: float = _f(
        0.0,
        "peak FLOP/s of one device for MFU; 0 = look up (GPU datasheet table) or measure once (CPU: the "
        "model's GEMMs in its dtype at the rank's thread count, cached). An MFU above 100% is never shown: "
        "the run warns that the peak is unreliable and names its source",
    )
    straggler_factor: float = _f(
        0.0,
        "name a straggler: every log step each rank's busy time a step (its step time less its wait in the step's "
        "closing all-reduce) and data time are gathered (one all-gather over the world); a rank whose excess over "
        "the other ranks' median makes its step this many times theirs, for straggler_log_steps log steps in a "
        "row, is named in one warning line (rank, host, its times vs the median), and metrics.jsonl gets the "
        "slowest rank and the spread. 0 = off; else > 1. Costs a device sync a step (docs/reliability.md)",
        bound=Bound(ge=0),
    )
    straggler_log_steps: int = _f(
        3, "with straggler_factor: log steps in a row a rank must be slow before it is named", bound=_POSITIVE
    )
