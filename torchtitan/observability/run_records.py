"""What a run leaves in its dump folder so that it can be reproduced from the folder alone.

``command.txt`` holds the command that started the run and, uncommented below it, one that reproduces
it when pasted into a shell: the same number of processes (``NGPU``), the same interpreter
(``PYTHON``), the same working directory (the config's relative paths), and the resolved
``config.toml`` (``CONFIG_FILE``), through ``run_llama_train.sh`` (or, outside a checkout, our
launcher); a config built by a function (``--module M --config F``) is named in a comment above it, and in
run_info.json with its module's file, so the run reproduces without the module. A resumed run appends its own
command; ``config.toml`` and ``run_info.json`` describe the latest launch. Which records a run owns
(``run_record_names``) is what a new run in the same folder sets aside first (launch/run_folder.py).
"""

from __future__ import annotations

import dataclasses
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

from torchtitan.config.mix import describe_sources
from torchtitan.distributed.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_SCRIPT = os.path.join(REPO, "run_llama_train.sh")
METRICS_FILE = "metrics.jsonl"
REPRODUCED = "-reproduced"  # the reproduce command's dump folder: the run's own, with this suffix


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def run_info(config: JobConfig, world_size: int, resumed_from: int | None = None) -> dict:
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world_size)
    t = config.training
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "git_commit": _git_commit(),
        "world_size": world_size,
        "layout": dims.degrees(),
        "resumed_from_step": resumed_from,
        "data": describe_sources(t.dataset, t.dataset_path, t.dataset_mix),  # a blend's sources and weights
        # --module/--config: the function that built the config (its module's file and the file's sha256); null: a TOML
        "config_function": None if config.built_by is None else dataclasses.asdict(config.built_by),
    }


def run_record_names(config: JobConfig) -> list[str]:
    """What a run writes in its dump folder (files and folders, relative to it)."""
    return [
        METRICS_FILE,
        "config.toml",
        "command.txt",
        "run_info.json",
        config.metrics.save_tb_folder,
        config.profiling.save_traces_folder,
        config.profiling.save_memory_snapshot_folder,
        config.checkpoint.folder,
        "hf",  # checkpoint.last_save_in_hf's exports
        # what a config section's feature writes there too (its ``run_records()``: RL's rollouts and policy folders)
        *(n for f in dataclasses.fields(config) for n in _section_records(getattr(config, f.name))),
    ]


def _section_records(section: object) -> list[str]:
    method = getattr(type(section), "run_records", None)
    return method(section) if method is not None else []


def reproduce_command(folder: str, world_size: int, *, nodes: int = 1) -> str:
    """A shell command that trains the run of ``folder`` (its config.toml) again with ``world_size`` processes,
    pasted anywhere, into ``<folder>-reproduced`` (in its own folder, a run with a checkpoint would resume)."""
    folder, cwd = os.path.abspath(folder), os.getcwd()
    config, out = os.path.join(folder, "config.toml"), ["--job.dump_folder", folder + REPRODUCED]
    if nodes == 1 and os.path.isfile(RUN_SCRIPT):
        env = f"NGPU={world_size} PYTHON={shlex.quote(sys.executable)} CONFIG_FILE={shlex.quote(config)}"
        return f"cd {shlex.quote(cwd)} && {env} {shlex.join([RUN_SCRIPT, *out])}"
    rendezvous = "localhost:0" if nodes == 1 else "HOST:PORT"
    launch = [sys.executable, "-m", "torchtitan.launch", f"--nnodes={nodes}", f"--nproc_per_node={world_size // nodes}"]
    launch += ["--rdzv_backend", "c10d", f"--rdzv_endpoint={rendezvous}"]
    return (
        f"cd {shlex.quote(cwd)} && {shlex.join([*launch, '-m', 'torchtitan.train', '--job.config_file', config, *out])}"
    )


def _started_by() -> str:
    """This rank's command line, or its launcher's under torchrun (the command the user ran)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                parts = [p.decode(errors="replace") for p in f.read().split(b"\0") if p]
            if parts:
                return "launcher: " + shlex.join(parts)
        except OSError:
            pass
    return "rank 0: " + shlex.join([sys.executable, *sys.argv])


def write_run_records(
    config: JobConfig, world_size: int, *, resumed_from: int | None = None, folder: str | None = None
) -> None:
    """config.toml (the resolved config), command.txt (the command line and the one that reproduces the
    run), run_info.json (versions, layout). ``resumed_from``: the checkpoint step a resume starts after
    (command.txt is then appended to); None: a new run. ``folder``: the run's folder (default the dump folder)."""
    folder = folder or config.job.dump_folder
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.toml"), "w") as f:
        f.write(config.to_toml())
    nodes = max(1, world_size // int(os.environ.get("LOCAL_WORLD_SIZE") or world_size))
    where = "" if nodes == 1 else f": {world_size // nodes} on each of {nodes} nodes, HOST:PORT your rendezvous"
    processes = f"{world_size} process{'es' if world_size > 1 else ''}{where}"
    with open(os.path.join(folder, "command.txt"), "w" if resumed_from is None else "a") as f:
        if resumed_from is not None:
            f.write(f"# resumed from checkpoint step-{resumed_from} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.write(f"# started by {_started_by()}\n")
        if config.built_by is not None:  # the line below trains config.toml: the function's values, resolved
            fn = config.built_by
            f.write(f"# config built by {fn.describe()} ({fn.file or 'no file'}); config.toml holds its values\n")
        f.write(f"# reproduce ({processes}; into {os.path.basename(os.path.abspath(folder))}{REPRODUCED}/):\n")
        f.write(reproduce_command(folder, world_size, nodes=nodes) + "\n")
    with open(os.path.join(folder, "run_info.json"), "w") as f:
        json.dump(run_info(config, world_size, resumed_from), f, indent=2)
