"""bench/gpu_check's environment section: the device, the packages and a 1-rank process group, as the trainer
joins one; and the GPU's and CPU's names that the figures (and the golden files) are read against."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.gpu_check.runs import GIB
from bench.gpu_check.sections import Context, error_record
from torchtitan.distributed.backend.device import DeviceInfo, get_device_info, init_distributed, synchronize
from torchtitan.observability.flops import get_peak_flops
from torchtitan.observability.peak_cache import cpu_model_name

PACKAGES = ("transformers", "safetensors", "tiktoken", "tokenizers", "numpy", "triton", "torchao", "datasets")


def environment(ctx: Context) -> dict[str, Any]:
    info = get_device_info()
    peak = get_peak_flops(ctx.device, torch.bfloat16)
    group = process_group_check(info)
    return {
        "status": group["status"],
        **({"error": f"process group: {group['error']}"} if group["status"] == "error" else {}),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": ctx.dry_run,
        "device": str(ctx.device),
        **_accelerator(ctx.device),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "bf16_peak_tflops": round(peak.flops / 1e12, 3),
        "bf16_peak_source": peak.source,
        "packages": {name: _version(name) for name in PACKAGES},
        "git_commit": _git_commit(),
        "layout": "1 process, world size 1: no mesh, no FSDP (the trainer shards only with dp_shard > 1); "
        "bf16 = autocast over fp32 weights",
        "process_group": group,
    }


def process_group_check(info: DeviceInfo) -> dict[str, Any]:
    """Join a 1-rank process group as the trainer does (``init_distributed``: NCCL on CUDA, gloo on CPU), all-reduce
    one tensor, leave. The runs themselves need no group at world size 1 (and the estimator makes its own)."""
    for key, value in (("MASTER_ADDR", "localhost"), ("MASTER_PORT", str(_free_port())), ("RANK", "0")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("WORLD_SIZE", "1")
    start = time.perf_counter()
    try:
        init_distributed(info, timeout_s=120)
        x = torch.ones(4, device=info.device)
        dist.all_reduce(x)
        synchronize(info.device)
        if x.tolist() != [1.0] * 4:
            raise RuntimeError(f"a 1-rank all-reduce of ones gave {x.tolist()}")
        return {"status": "ok", "backend": dist.get_backend(), "seconds": round(time.perf_counter() - start, 2)}
    except Exception as e:
        return {**error_record("process group", e), "backend": info.backend}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def gpu_name(device: torch.device) -> str | None:
    """The GPU's name as the driver reports it (e.g. 'NVIDIA H100 80GB HBM3'); None off CUDA."""
    if device.type != "cuda":  # device-choice: only CUDA devices have these properties here
        return None
    return torch.cuda.get_device_properties(device).name


# The instruction sets CPU figures are read against: bf16 runs ~15x slower on an AVX2-only CPU (.ci/run names them too)
CPU_ISA = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_model() -> str:
    """The CPU's model name and the ``CPU_ISA`` flags it has (/proc/cpuinfo on Linux), e.g. '... Xeon ... (avx2 amx_bf16)'."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    flags = next((line.partition(":")[2].split() for line in lines if line.startswith("flags")), [])
    isa = " ".join(f for f in CPU_ISA if f in flags)
    return f"{cpu_model_name()} ({isa or 'none of ' + '/'.join(CPU_ISA)})"


def _accelerator(device: torch.device) -> dict[str, Any]:
    name = gpu_name(device)
    if name is None:
        return {"gpu": None}
    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": name,
        "compute_capability": f"{props.major}.{props.minor}",
        "gpu_memory_gib": round(props.total_memory / GIB, 1),
        "driver": _nvidia_smi("driver_version"),
        "nccl": _nccl_version(),
    }


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _nvidia_smi(field: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        cmd = ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    repo = Path(__file__).resolve().parents[1]
    try:
        cmd = ["git", "-C", str(repo), "rev-parse", "HEAD"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
