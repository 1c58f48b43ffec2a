"""Training metrics: device memory, MFU math, and the JSONL/TensorBoard metric logger."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import resource
import sys
import time
from dataclasses import dataclass
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.observability.flops import LinearShape, PeakFlops, get_peak_flops, measure_matmul_flops

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

__all__ = [
    "DeviceMemStats",
    "DeviceMemoryMonitor",
    "LinearShape",
    "MetricLogger",
    "PeakFlops",
    "build_device_memory_monitor",
    "build_metric_logger",
    "compute_mfu",
    "compute_num_flops_per_token",
    "get_peak_flops",
    "measure_matmul_flops",
]

logger = logging.getLogger(__name__)

_GIB = 1024**3


# ---------------------------------------------------------------------------------------------
# Device memory
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceMemStats:
    """Memory use since the last `reset_peak_stats()`, in GiB.

    On CPU all three sizes are the process's resident memory (see `CpuMemoryMonitor`) and the
    two counters are always 0: the CPU allocator has no retries and an OOM kills the process.
    """

    max_active_gib: float
    max_reserved_gib: float
    current_gib: float
    num_alloc_retries: int
    num_ooms: int


class DeviceMemoryMonitor:
    """Peak-memory tracker for one device; build it with `build_device_memory_monitor`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peak_stats(self) -> None:
        raise NotImplementedError

    def get_peak_stats(self) -> DeviceMemStats:
        raise NotImplementedError


class AcceleratorMemoryMonitor(DeviceMemoryMonitor):
    """CUDA/ROCm (or any `torch.accelerator` device): the caching allocator's own counters."""

    def reset_peak_stats(self) -> None:
        torch.accelerator.reset_peak_memory_stats(self.device)

    def get_peak_stats(self) -> DeviceMemStats:
        stats = torch.accelerator.memory_stats(self.device)
        # "active" counts blocks holding live tensors, which is what a model needs; "reserved"
        # adds the allocator's cache and fragmentation, which is what triggers an OOM.
        return DeviceMemStats(
            max_active_gib=stats.get("active_bytes.all.peak", 0) / _GIB,
            max_reserved_gib=stats.get("reserved_bytes.all.peak", 0) / _GIB,
            current_gib=torch.accelerator.memory_allocated(self.device) / _GIB,
            num_alloc_retries=int(stats.get("num_alloc_retries", 0)),
            num_ooms=int(stats.get("num_ooms", 0)),
        )


class CpuMemoryMonitor(DeviceMemoryMonitor):
    """CPU: peak and current resident set size (RSS) of the whole process.

    torch keeps no allocator statistics for CPU tensors, so this is *not* tensor memory: it
    includes the Python interpreter, the torch libraries, data loader buffers and anything else
    the process has resident. Use it to see growth, and to size the host, not as a model footprint.

    The peak is `VmHWM` from `/proc/self/status`, reset by writing "5" to `/proc/self/clear_refs`
    (Linux >= 4.0). Where that is not possible (no /proc, e.g. macOS, or a locked-down sandbox)
    the peak falls back to `getrusage(RUSAGE_SELF).ru_maxrss`, which cannot be reset: it is then
    the peak since the process started, and `reset_peak_stats()` does nothing. Without /proc the
    current RSS is reported as 0.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._can_reset = self._try_clear_refs()
        if not self._can_reset:
            logger.warning(
                "cannot reset the process peak RSS (/proc/self/clear_refs not writable); CPU "
                "peak memory is reported since process start"
            )

    @staticmethod
    def _try_clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return False
        return True

    def reset_peak_stats(self) -> None:
        if self._can_reset:
            self._try_clear_refs()

    def get_peak_stats(self) -> DeviceMemStats:
        current = _current_rss_bytes()
        peak = max(_peak_rss_bytes(), current)
        return DeviceMemStats(
            max_active_gib=peak / _GIB,
            max_reserved_gib=peak / _GIB,
            current_gib=current / _GIB,
            num_alloc_retries=0,
            num_ooms=0,
        )


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux but in bytes on macOS.
    return max_rss if sys.platform == "darwin" else max_rss * 1024


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except OSError:
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def build_device_memory_monitor(device: torch.device) -> DeviceMemoryMonitor:
    """Return a memory monitor for `device` with its peak statistics freshly reset."""
    monitor: DeviceMemoryMonitor
    if device.type == "cpu":
        monitor = CpuMemoryMonitor(device)
    else:
        monitor = AcceleratorMemoryMonitor(device)
    monitor.reset_peak_stats()
    return monitor


# ---------------------------------------------------------------------------------------------
# MFU math
# ---------------------------------------------------------------------------------------------


def compute_num_flops_per_token(
    num_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int, attention_pairs: float | None = None
) -> float:
    """Training FLOPs (forward + backward) per token of a decoder-only transformer.

    Args:
        num_params: parameters excluding the input embedding table (a lookup, no matmul).
        attention_pairs: the (query, key) pairs attention computes per token, where the mask decides
            them (block_causal: the visible pairs of the step's windows over their tokens); None:
            ``seq_len``, the full-matrix convention below.
    """
    # Dense matmuls: a weight of N params costs 2N FLOPs per token forward (multiply + add), and
    # backward costs twice that (grad w.r.t. inputs and w.r.t. weights): 6N in total.
    # Attention adds matmuls with no weights: per layer and token, q @ k^T is 2 * seq_len *
    # n_heads * head_dim forward and scores @ v the same, so 4 * L * H * D * T forward and
    # 12 * L * H * D * T with backward. This counts the full (non-causal) T x T score matrix,
    # matching the PaLM appendix-B convention that MFU numbers are usually quoted in.
    # block_causal counts only the pairs its documents leave visible (docs/attention.md): with short
    # documents far fewer than seq_len / 2, so its MFU is not comparable with a causal run's.
    pairs = seq_len if attention_pairs is None else attention_pairs
    return 6 * num_params + 12 * n_layers * n_heads * head_dim * pairs


def model_flops_per_token(num_params: int, args, seq_len: int, attention_pairs: float | None = None) -> float:
    """``compute_num_flops_per_token`` for a model's ``args``: softmax attention in its ``attention_layers`` (default
    every layer), plus the weightless FLOPs of its other token mixers (``mixer_flops_per_token``, default 0:
    Qwen3.5's Gated DeltaNet layers)."""
    layers = getattr(args, "attention_layers", args.n_layers)
    flops = compute_num_flops_per_token(num_params, layers, args.n_heads, args.head_dim, seq_len, attention_pairs)
    return flops + getattr(args, "mixer_flops_per_token", 0)


def compute_mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation in percent: achieved FLOP/s over the device's peak FLOP/s.

    Pass per-device throughput and per-device peak (or totals for both).
    """
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
    return 100.0 * tokens_per_second * flops_per_token / peak_flops


# ---------------------------------------------------------------------------------------------
# Metric logger
# ---------------------------------------------------------------------------------------------


class MetricLogger:
    """Writes per-step scalars to `metrics.jsonl` and optionally TensorBoard.

    Build it with `build_metric_logger`. A logger built with neither sink (non-logging ranks)
    accepts every call and does nothing, so callers need no rank checks.
    """

    def __init__(
        self, jsonl_file: IO[str] | None = None, tb_writer: Any | None = None, wandb_run: Any | None = None
    ) -> None:
        self._jsonl_file = jsonl_file
        self._tb_writer = tb_writer
        self._wandb_run = wandb_run

    def log(self, step: int, metrics: dict[str, Any], *, tb_extra: dict[str, float] | None = None) -> None:
        """Record `metrics` for `step`.

        Floats are written by `json` with `repr` precision, so they read back bit-exact; NaN and
        infinities are written as `NaN`/`Infinity`, which Python's `json` reads back. Values that
        are not numbers (e.g. per-expert load lists) go to the JSON file only; TensorBoard gets the
        numbers plus ``tb_extra`` (scalars named for TensorBoard, e.g. "moe/layers.1/imbalance").
        None (e.g. an MFU withheld as unreliable) is written as JSON null and not sent elsewhere.
        """
        if self._jsonl_file is not None:
            self._jsonl_file.write(json.dumps({"step": step, **metrics}) + "\n")
            # Flush each step so a crash or a `tail -f` sees every logged step.
            self._jsonl_file.flush()
        if self._tb_writer is not None:
            scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            for name, value in {**scalars, **(tb_extra or {})}.items():
                self._tb_writer.add_scalar(name, value, step)
            self._tb_writer.flush()
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def close(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._jsonl_file is not None:
            self._jsonl_file.close()
            self._jsonl_file = None
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def build_metric_logger(
    dump_folder: str,
    *,
    enabled: bool,
    enable_tensorboard: bool,
    save_tb_folder: str,
    append: bool = False,
    enable_wandb: bool = False,
    wandb_config: dict[str, Any] | None = None,
) -> MetricLogger:
    """Build the run's metric logger.

    Args:
        enabled: True only on the rank that logs; otherwise every method is a no-op.
        enable_tensorboard: also write scalars under `<dump_folder>/<save_tb_folder>/<timestamp>`.
        enable_wandb: also log to Weights & Biases (project from WANDB_PROJECT, default "torchtitan";
            files under `<dump_folder>/wandb`); `wandb_config` is recorded as the run's config.
        append: keep an existing `<dump_folder>/metrics.jsonl` (a resumed run) instead of
            truncating it.

    Raises:
        ImportError: TensorBoard is requested but the `tensorboard` package is missing.
    """
    if not enabled:
        return MetricLogger()
    # Import first so a missing package fails before any file is created.
    tb_writer = _build_tb_writer(dump_folder, save_tb_folder) if enable_tensorboard else None
    wandb_run = _build_wandb_run(dump_folder, wandb_config) if enable_wandb else None
    os.makedirs(dump_folder, exist_ok=True)
    jsonl_path = os.path.join(dump_folder, "metrics.jsonl")
    jsonl_file = open(jsonl_path, "a" if append else "w", encoding="utf-8")
    logger.info("writing metrics to %s", jsonl_path)
    return MetricLogger(jsonl_file, tb_writer, wandb_run)


def _build_wandb_run(dump_folder: str, config: dict[str, Any] | None) -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            "metrics.enable_wandb is set but the wandb package is not installed: run `pip install wandb`, "
            "or turn Weights & Biases logging off"
        ) from e
    os.makedirs(dump_folder, exist_ok=True)
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "torchtitan"), dir=dump_folder, config=config)


def _build_tb_writer(dump_folder: str, save_tb_folder: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError(
            "TensorBoard logging is enabled but the tensorboard package is not installed: "
            "run `pip install tensorboard`, or turn TensorBoard logging off"
        ) from e
    # A timestamped subfolder keeps runs that share a dump folder apart in the TensorBoard UI.
    log_dir = os.path.join(dump_folder, save_tb_folder, time.strftime("%Y%m%d-%H%M%S"))
    logger.info("writing TensorBoard events to %s", log_dir)
    return SummaryWriter(log_dir=log_dir)


def check_metrics(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Pre-launch: wandb installed when asked for (found, not imported); keys with no effect warned."""
    if config.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.enable_wandb = true but the wandb package is not installed; `pip install wandb`")
    factor = config.metrics.straggler_factor
    if 0 < factor <= 1:
        raise ConfigError(
            f"metrics.straggler_factor = {factor}: a straggler is slower than the others by a factor > 1 "
            "(e.g. 1.5), or 0 for off"
        )
    warnings = []
    if factor > 0 and dims.world_size == 1:
        warnings.append("metrics.straggler_factor has no effect with one process: there is no other rank to compare")
    if config.metrics.rank_0_only is False:
        warnings.append("metrics.rank_0_only = false has no effect: only the logging rank writes metrics")
    return warnings
