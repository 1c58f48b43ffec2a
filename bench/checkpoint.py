"""Checkpoint saves on CPU: the training time each save blocks, for checkpoint.async_mode = disabled / async /
async_with_pinned_mem side by side, and save / load GB/s against the disk's own write / read speed, measured in
the same run on the same folder.

Each mode is the real trainer (``Trainer`` through its ``Builders`` seam, one process) on a llama of ~107 M
parameters (dim 1024, 8 layers, 8 heads, the shipped 2,048-word tokenizer: 0.43 GB of fp32 weights, 1.3 GB of
checkpoint with AdamW's moments), saving every ``--interval`` steps (``--saves`` saves, then, an interval later, the
final save, which is synchronous in every mode and not counted). Per mode: the seconds each save blocked the
training thread (the manager's own count: the save call, for async_with_pinned_mem the wait for the staging copy
before the next optimizer step, and any wait for its background write when the next save came first), median over
the saves; from metrics.jsonl (log_freq 1: a save's blocking lands in the next step's time, as does the contention
of background work for the cores): the median step just after a save and of the other steps; the wall time of the
run (the same steps and saves in every mode). On a machine shared with other jobs the step times move with their
load (the JSON records the load average before and after); the blocked seconds are waits, not compute, and move
much less.

Speeds, on ``--folder`` (default: a temporary folder): the disk's sequential write (a plain write of the
checkpoint's byte count in 16 MiB pieces, then fsync) and read (after posix_fadvise DONTNEED, so from the disk, not
the page cache, where the kernel honours it); our synchronous save (bytes / the median sync save), a plain DCP save
of the same state (FileSystemWriter, no CRC32 sidecars), zlib.crc32 on this CPU; the load a resume runs (CRC32
verification, then DCP's read) and its two parts, each from a cold page cache. Prints one JSON object;
docs/performance.md has the figures.

    python -m bench.checkpoint [--saves 3] [--interval 4] [--seq_len 32] [--batch_size 1] [--folder DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from torchtitan.build import build_model_args
from torchtitan.checkpointing.files import integrity
from torchtitan.checkpointing.files.folders import find_resume_checkpoint
from torchtitan.checkpointing.files.marker import step_folder
from torchtitan.checkpointing.state import ModelState, OptimizerState
from torchtitan.config.manager import JobConfig
from torchtitan.engine.builders import Builders
from torchtitan.observability.peak_cache import cpu_model_name
from torchtitan.preflight import run_preflight
from torchtitan.train import Trainer

MODES = ("disabled", "async", "async_with_pinned_mem")
DIMS = {"dim": 1024, "n_layers": 8, "n_heads": 8}
_PIECE = 16 * 2**20
_GB = 1e9


def _model_args(config, spec, vocab_size, *, device_type=None):
    """The bench's size: the debug flavor's args with ``DIMS``."""
    return dataclasses.replace(build_model_args(config, spec, vocab_size, device_type=device_type), **DIMS)


def _config(args: argparse.Namespace, mode: str, folder: str) -> JobConfig:
    steps = (args.saves + 1) * args.interval  # the final save comes an interval after the last one counted
    return JobConfig.parse_args(
        [
            "--job.config_file",
            "train_configs/debug_model.toml",
            "--job.dump_folder",
            folder,
            "--training.steps",
            str(steps),
            "--training.seq_len",
            str(args.seq_len),
            "--training.batch_size",
            str(args.batch_size),
            "--training.warmup_steps",
            "2",
            "--metrics.log_freq",
            "1",
            "--checkpoint.enable_checkpoint",
            "--checkpoint.interval",
            str(args.interval),
            "--checkpoint.keep_latest_k",
            "1",
            "--checkpoint.async_mode",
            mode,
        ]
    )


def _folder_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))
    )


def _drop_cache(paths: list[str]) -> None:
    """Ask the kernel to drop these files' pages (they are clean: written with fsync, or only read)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _files(path: str) -> list[str]:
    return [os.path.join(path, n) for n in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, n))]


def _disk_speeds(folder: str, nbytes: int) -> dict[str, float]:
    """Sequential write (with fsync) and cold read of ``nbytes`` in 16 MiB pieces, in GB/s."""
    piece = os.urandom(_PIECE)
    path = os.path.join(folder, "disk_speed.bin")
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(-(-nbytes // _PIECE)):
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - start
    _drop_cache([path])
    buf = bytearray(_PIECE)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - start
    size = os.path.getsize(path)
    os.remove(path)
    return {"write_gb_s": round(size / write_s / _GB, 3), "read_gb_s": round(size / read_s / _GB, 3)}


def _crc32_gb_s() -> float:
    data = os.urandom(256 * 2**20)
    start = time.perf_counter()
    zlib.crc32(data)
    return round(len(data) / (time.perf_counter() - start) / _GB, 3)


def _step_times(folder: str, args: argparse.Namespace) -> dict[str, float]:
    """From metrics.jsonl: the median step just after a save and of the other steps (past 2 warm-up steps)."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        times = {r["step"]: r["step_time_s"] for r in map(json.loads, f) if "step_time_s" in r}
    after = {s + 1 for s in range(args.interval, args.saves * args.interval + 1, args.interval)}
    return {
        "step_s": round(statistics.median(t for s, t in times.items() if s > 2 and s not in after), 3),
        "step_after_save_s": round(statistics.median(times[s] for s in after), 3),
    }


def _load_speeds(trainer: Trainer, path: str, nbytes: int) -> dict[str, float]:
    """A resume's load of ``path`` (the newest checkpoint) and its two parts, each from a cold page cache."""
    files = _files(path)
    _drop_cache(files)
    start = time.perf_counter()
    trainer.checkpointer.load()
    load_s = time.perf_counter() - start
    _drop_cache(files)
    start = time.perf_counter()
    find_resume_checkpoint(os.path.dirname(path), -1, True)
    verify_s = time.perf_counter() - start
    _drop_cache(files)
    view = trainer.model_parts[0]
    state = {"model": ModelState(view), "optimizer": OptimizerState(view, trainer.optimizer)}
    start = time.perf_counter()
    integrity.load(state, path, no_dist=True)
    read_s = time.perf_counter() - start
    return {
        "load_s": round(load_s, 3),
        "load_gb_s": round(nbytes / load_s / _GB, 3),
        "verify_crc32_s": round(verify_s, 3),
        "dcp_read_s": round(read_s, 3),
        "dcp_read_gb_s": round(nbytes / read_s / _GB, 3),
    }


def _plain_dcp_save_s(trainer: Trainer, folder: str) -> float:
    """A synchronous DCP save of the model and optimizer through DCP's own writer (no CRC32, no marker)."""
    view = trainer.model_parts[0]
    state = {"model": ModelState(view), "optimizer": OptimizerState(view, trainer.optimizer)}
    path = os.path.join(folder, "plain_dcp")
    start = time.perf_counter()
    dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
    seconds = time.perf_counter() - start
    shutil.rmtree(path)
    return seconds


def _run_mode(args: argparse.Namespace, mode: str, root: str) -> tuple[dict, Trainer, str]:
    folder = os.path.join(root, mode)
    config = _config(args, mode, folder)
    run_preflight(config, world_size=1)
    trainer = Trainer(config, world_size=1, rank=0, builders=Builders(model_args=_model_args))
    start = time.perf_counter()
    try:
        trainer.train()
    finally:
        trainer.close()
    train_s = time.perf_counter() - start
    final = config.training.steps
    blocked = [s for step, s in sorted(trainer.checkpointer.blocked_seconds.items()) if step != final]
    out = {
        "blocked_s": round(statistics.median(blocked), 3),
        "blocked_each_s": [round(s, 3) for s in blocked],
        "final_sync_save_s": round(trainer.checkpointer.blocked_seconds[final], 3),
        **_step_times(folder, args),
        "train_s": round(train_s, 1),
    }
    return out, trainer, step_folder(os.path.join(folder, "checkpoint"), final)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--folder", default=None, help="where the checkpoints go (default: a temporary folder)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    root = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.folder)
    out: dict = {
        "cpu": cpu_model_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "command": "python -m bench.checkpoint " + " ".join(sys.argv[1:]),
        "folder": root,
        "load_average_before": os.getloadavg(),
        **{k: getattr(args, k) for k in ("saves", "interval", "seq_len", "batch_size")},
    }
    try:
        for mode in MODES:
            print(f"bench.checkpoint: {mode} ...", file=sys.stderr)
            out[mode], trainer, last = _run_mode(args, mode, root)
            if mode == "disabled":
                nbytes = _folder_bytes(last)
                out["params"] = sum(p.numel() for p in trainer.model_parts[0].parameters())
                out["checkpoint_gb"] = round(nbytes / _GB, 3)
                sync_s = statistics.median(out["disabled"]["blocked_each_s"])
                out["save"] = {
                    "sync_save_gb_s": round(nbytes / sync_s / _GB, 3),
                    "plain_dcp_save_gb_s": round(nbytes / _plain_dcp_save_s(trainer, root) / _GB, 3),
                    "crc32_gb_s": _crc32_gb_s(),
                }
                out["load"] = _load_speeds(trainer, last, nbytes)
                out["disk"] = _disk_speeds(root, nbytes)
            shutil.rmtree(os.path.join(root, mode))
            del trainer
            gc.collect()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sync = out["disabled"]["blocked_s"]
    for mode in MODES[1:]:
        out[mode]["blocked_vs_sync"] = round(out[mode]["blocked_s"] / sync, 4)
    out["save"]["sync_save_vs_disk_write"] = round(out["save"]["sync_save_gb_s"] / out["disk"]["write_gb_s"], 3)
    out["load"]["load_vs_disk_read"] = round(out["load"]["load_gb_s"] / out["disk"]["read_gb_s"], 3)
    out["load_average_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
