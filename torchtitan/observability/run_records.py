"""What a run leaves in its dump folder so that it can be reproduced from the folder alone."""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import torch

from torchtitan.distributed.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig


def _git_commit() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def run_info(config: JobConfig, world_size: int) -> dict:
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world_size)
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "git_commit": _git_commit(),
        "world_size": world_size,
        "layout": dims.degrees(),
    }


def write_run_records(config: JobConfig, world_size: int) -> None:
    """config.toml (the resolved config), command.txt (the command line), run_info.json (versions, layout)."""
    folder = config.job.dump_folder
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.toml"), "w") as f:
        f.write(config.to_toml())
    with open(os.path.join(folder, "command.txt"), "w") as f:
        launcher = f"torchrun --nproc_per_node={world_size} " if world_size > 1 else ""
        f.write(launcher + shlex.join([sys.executable, "-m", "torchtitan.train", *sys.argv[1:]]) + "\n")
        f.write(
            f"# reproduce: {launcher}python -m torchtitan.train --job.config_file {os.path.join(folder, 'config.toml')}\n"
        )
    with open(os.path.join(folder, "run_info.json"), "w") as f:
        json.dump(run_info(config, world_size), f, indent=2)
