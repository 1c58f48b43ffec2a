"""The one place that chooses the device and the process-group backend; everything else is passed them."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan.distributed.backend.c10d_compat import set_timeout

# The device kinds get_device_info chooses between (``python -m torchtitan.preflight --target`` names one).
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class DeviceInfo:
    device: torch.device
    backend: str  # for init_process_group, e.g. "cpu:gloo,cuda:nccl"


def get_device_info(local_rank: int | None = None) -> DeviceInfo:
    """CUDA + NCCL where a GPU exists (one GPU per local rank), else CPU + gloo."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        # gloo stays registered for CPU tensors (e.g. a CPU-side dataloader state exchange).
        return DeviceInfo(
            torch.device("cuda", local_rank % torch.cuda.device_count()), "cpu:gloo,cuda:nccl"
        )  # device-choice
    return DeviceInfo(torch.device("cpu"), "gloo")


def init_distributed(info: DeviceInfo, timeout_s: int, trace_buf_size: int = 0) -> None:
    """Join the process group torchrun describes (RANK/WORLD_SIZE/MASTER_ADDR in the environment).

    ``trace_buf_size``: NCCL's flight recorder keeps this many entries of collective history for
    post-mortem dumps (0: off); read by NCCL process groups only, from the environment, at init. An
    explicit ``TORCH_NCCL_TRACE_BUFFER_SIZE`` in the environment wins.
    """
    if "nccl" in info.backend:
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(trace_buf_size))
    if info.device.type != "cpu":
        torch.accelerator.set_device_index(info.device.index)
    kwargs = {"device_id": info.device} if info.device.type != "cpu" else {}
    dist.init_process_group(backend=info.backend, timeout=timedelta(seconds=timeout_s), **kwargs)


def set_pg_timeout(timeout_s: int) -> None:
    """Shorten the collective timeout once the first (slow, compiling) step is done."""
    if dist.is_initialized():
        set_timeout(timedelta(seconds=timeout_s))


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``, e.g. before reading a timer.

    CPU ops are synchronous; accelerators queue work and return at once.
    """
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


@dataclass(frozen=True)
class ProcessFlags:
    """The process-wide switches a run may change: ``set_determinism``'s, the oneDNN switch a float8 run on a CPU
    turns off (float8.py ``turn_off_onednn``) and inductor's async-TP pass (parallelize.py).

    ``Trainer`` reads them when it is built and puts them back when it is closed, so a second run in the same
    process (a notebook, the GPU check's rows, the tests' worker pool) does not inherit them: on an H100, rows run
    after a deterministic one read 7-20% slower, and on CPU every bf16 GEMM after a float8 build ran ~4x slower
    (docs/performance.md)."""

    deterministic: bool
    warn_only: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    onednn: bool
    micro_pipeline_tp: bool

    @classmethod
    def read(cls) -> ProcessFlags:
        cudnn = torch.backends.cudnn
        return cls(
            deterministic=torch.are_deterministic_algorithms_enabled(),
            warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn_deterministic=cudnn.deterministic,
            cudnn_benchmark=cudnn.benchmark,
            onednn=torch.backends.mkldnn.enabled,
            micro_pipeline_tp=bool(getattr(sys.modules.get("torch._inductor.config"), "_micro_pipeline_tp", False)),
        )

    def restore(self) -> None:
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.mkldnn.enabled = self.onednn
        if (inductor := sys.modules.get("torch._inductor.config")) is not None:  # imported by a compile, if any
            inductor._micro_pipeline_tp = self.micro_pipeline_tp


def set_determinism(seed: int | None, deterministic: bool) -> None:
    """Seed torch (None = 0); with ``deterministic``, deterministic kernels on every device (until the run's
    ``Trainer.close``, which restores the ``ProcessFlags`` it found)."""
    torch.manual_seed(0 if seed is None else seed)
    if deterministic:
        # Deterministic cuBLAS needs a fixed workspace; read when the first CUDA matmul runs.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
