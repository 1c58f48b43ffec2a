from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from torchtitan.observability import flops
from torchtitan.observability.logging import warn_once
from torchtitan.observability.metrics import (
    DeviceMemStats,
    LinearShape,
    build_device_memory_monitor,
    build_metric_logger,
    compute_mfu,
    compute_num_flops_per_token,
    get_peak_flops,
    measure_matmul_flops,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


# --------------------------------------------------------------------------- MFU math


def test_flops_per_token_hand_computed() -> None:
    # 6 * 1000 = 6000; 12 * 2 layers * 4 heads * 8 head_dim * 16 seq = 12288.
    assert compute_num_flops_per_token(1000, n_layers=2, n_heads=4, head_dim=8, seq_len=16) == 18288


def test_mfu_percent() -> None:
    # 1000 tok/s * 1e9 FLOP/tok = 1e12 FLOP/s, a quarter of a 4e12 peak.
    assert compute_mfu(1000.0, 1e9, 4e12) == pytest.approx(25.0)


def test_mfu_rejects_zero_peak() -> None:
    with pytest.raises(ValueError, match="peak_flops"):
        compute_mfu(1.0, 1.0, 0.0)


# --------------------------------------------------------------------------- peak FLOPS


def test_override_wins_without_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flops, "measure_matmul_flops", _fail)
    assert get_peak_flops(CPU, torch.float32, override=123.0).flops == 123.0
    assert get_peak_flops(CUDA, torch.bfloat16, override=5e14).flops == 5e14


@pytest.mark.parametrize(
    "name, dtype, tflops",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
        ("NVIDIA H100 NVL", torch.float16, 835.0),
        ("NVIDIA H200", torch.bfloat16, 989.0),
        ("NVIDIA H20", torch.bfloat16, 148.0),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("NVIDIA A10G", torch.bfloat16, 70.0),
        ("NVIDIA L4", torch.bfloat16, 121.0),
        ("NVIDIA L40S", torch.bfloat16, 362.05),
        ("NVIDIA B200", torch.bfloat16, 2250.0),
        ("AMD Instinct MI300X", torch.bfloat16, 1307.4),
    ],
)
def test_gpu_table_lookup(monkeypatch: pytest.MonkeyPatch, name: str, dtype: torch.dtype, tflops: float) -> None:
    monkeypatch.setattr(flops, "_get_device_name", lambda device: name)
    assert get_peak_flops(CUDA, dtype).flops == pytest.approx(tflops * 1e12)


def test_gpu_fp32_follows_tf32_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    # our own seam, not torch's backend module: pytest 9's undo cannot restore cuBLASModule's computed attribute
    monkeypatch.setattr(flops, "_get_device_name", lambda device: "NVIDIA A100-SXM4-40GB")
    monkeypatch.setattr(flops, "tf32_matmul_enabled", lambda: True)
    assert get_peak_flops(CUDA, torch.float32).flops == pytest.approx(156e12)
    monkeypatch.setattr(flops, "tf32_matmul_enabled", lambda: False)
    assert get_peak_flops(CUDA, torch.float32).flops == pytest.approx(19.5e12)


def test_tf32_matmul_enabled_reads_torch_setting() -> None:
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on
        assert flops.tf32_matmul_enabled()
        torch.set_float32_matmul_precision("highest")
        assert not flops.tf32_matmul_enabled()
    finally:
        torch.set_float32_matmul_precision(before)


def test_unknown_gpu_warns_and_uses_h100(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    warn_once.cache_clear()
    monkeypatch.setattr(flops, "_get_device_name", lambda device: "Mystery GPU 9000")
    with caplog.at_level(logging.WARNING, logger="torchtitan.observability.flops"):
        assert get_peak_flops(CUDA, torch.bfloat16).flops == pytest.approx(989e12)
    assert "Mystery GPU 9000" in caplog.text


def test_gpu_unsupported_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flops, "_get_device_name", lambda device: "NVIDIA H100")
    with pytest.raises(NotImplementedError, match="float64"):
        get_peak_flops(CUDA, torch.float64)


def _fail(*args: object, **kwargs: object) -> float:
    raise AssertionError("should not measure")


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "torchtitan" / "peak_flops.json"


def _count_measurements(monkeypatch: pytest.MonkeyPatch, value: float) -> list[torch.dtype]:
    calls: list[torch.dtype] = []

    def fake_measure(device: torch.device, dtype: torch.dtype, linears: object = None) -> float:
        calls.append(dtype)
        return value

    monkeypatch.setattr(flops, "measure_matmul_flops", fake_measure)
    return calls


def test_cpu_peak_is_measured_once_then_cached(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_measurements(monkeypatch, 4.5e11)
    assert get_peak_flops(CPU, torch.float32).flops == 4.5e11
    assert get_peak_flops(CPU, torch.float32).flops == 4.5e11
    assert calls == [torch.float32]
    get_peak_flops(CPU, torch.bfloat16)  # another dtype is another key
    assert calls == [torch.float32, torch.bfloat16]
    entries = json.loads(cache_home.read_text())
    assert len(entries) == 2
    key = next(k for k in entries if "float32" in k)
    assert f"threads={torch.get_num_threads()}" in key and torch.__version__ in key


def test_corrupt_cache_is_remeasured_and_rewritten(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache_home.parent.mkdir(parents=True)
    cache_home.write_text("{not json")
    calls = _count_measurements(monkeypatch, 7e10)
    with caplog.at_level(logging.WARNING, logger="torchtitan.observability.flops"):
        assert get_peak_flops(CPU, torch.float32).flops == 7e10
    assert "the file is unreadable" in caplog.text and "re-measured" in caplog.text and calls == [torch.float32]
    assert list(json.loads(cache_home.read_text()).values()) == [7e10]


def test_non_object_cache_is_ignored(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache_home.parent.mkdir(parents=True)
    cache_home.write_text("[1, 2]")
    _count_measurements(monkeypatch, 3e10)
    assert get_peak_flops(CPU, torch.float32).flops == 3e10


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_cache_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o500)
    monkeypatch.setenv("XDG_CACHE_HOME", str(read_only))
    _count_measurements(monkeypatch, 2e10)
    with caplog.at_level(logging.WARNING, logger="torchtitan.observability.flops"):
        assert get_peak_flops(CPU, torch.float32).flops == 2e10
    assert "could not write" in caplog.text


def test_unwritable_cache_path_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A file where the cache directory should be fails for root too.
    (tmp_path / "torchtitan").write_text("in the way")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _count_measurements(monkeypatch, 2e10)
    with caplog.at_level(logging.WARNING, logger="torchtitan.observability.flops"):
        assert get_peak_flops(CPU, torch.float32).flops == 2e10
    assert "could not write" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_cpu_measurement_is_plausible(dtype: torch.dtype) -> None:
    measured = measure_matmul_flops(CPU, dtype, (LinearShape(128, 128, 128),), budget_s=0.05)
    # Any CPU from the last 15 years does more than 0.1 GFLOP/s and less than 100 TFLOP/s.
    assert 1e8 < measured < 1e14


# --------------------------------------------------------------------------- memory


def test_cpu_memory_monitor_sees_allocation_and_resets() -> None:
    monitor = build_device_memory_monitor(CPU)
    baseline = monitor.get_peak_stats()
    assert isinstance(baseline, DeviceMemStats)
    assert baseline.max_active_gib > 0 and baseline.current_gib > 0
    assert baseline.num_alloc_retries == 0 and baseline.num_ooms == 0

    big = torch.ones(50 * 1024 * 1024, dtype=torch.float32)  # 200 MiB, pages touched
    grown = monitor.get_peak_stats()
    assert grown.max_active_gib >= baseline.max_active_gib + 0.18
    assert grown.current_gib >= baseline.current_gib + 0.18
    del big

    monitor.reset_peak_stats()
    after_reset = monitor.get_peak_stats()
    if Path("/proc/self/clear_refs").exists():
        assert after_reset.max_active_gib < grown.max_active_gib - 0.1


# --------------------------------------------------------------------------- metric logger


def _read_jsonl(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_round_trips_floats_exactly(tmp_path: Path) -> None:
    values = {"loss": 1 / 3, "lr": 3e-4 * math.pi, "tiny": 5e-324, "mfu": 41.0}
    with build_metric_logger(
        str(tmp_path), enabled=True, enable_tensorboard=False, save_tb_folder="tb"
    ) as metric_logger:
        metric_logger.log(1, values)
        metric_logger.log(2, {"loss": 0.1 + 0.2})
        # Flushed per call: readable before close.
        assert len(_read_jsonl(tmp_path / "metrics.jsonl")) == 2
    rows = _read_jsonl(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 1, **values}, {"step": 2, "loss": 0.1 + 0.2}]
    assert not (tmp_path / "tb").exists()


def test_jsonl_truncates_unless_append(tmp_path: Path) -> None:
    kwargs = dict(enabled=True, enable_tensorboard=False, save_tb_folder="tb")
    for step, append in [(1, False), (2, True), (3, False), (4, True)]:
        with build_metric_logger(str(tmp_path), append=append, **kwargs) as metric_logger:
            metric_logger.log(step, {"loss": float(step)})
    assert [row["step"] for row in _read_jsonl(tmp_path / "metrics.jsonl")] == [3, 4]


def test_disabled_logger_writes_nothing(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    metric_logger = build_metric_logger(str(dump), enabled=False, enable_tensorboard=True, save_tb_folder="tb")
    metric_logger.log(1, {"loss": 1.0})
    metric_logger.close()
    assert not dump.exists()


def test_tensorboard_event_file_appears(tmp_path: Path) -> None:
    with build_metric_logger(
        str(tmp_path), enabled=True, enable_tensorboard=True, save_tb_folder="tb"
    ) as metric_logger:
        metric_logger.log(1, {"loss": 2.5})
    (run_dir,) = (tmp_path / "tb").iterdir()
    events = list(run_dir.glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0


def test_missing_tensorboard_names_pip_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import raise ImportError.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        build_metric_logger(str(tmp_path), enabled=True, enable_tensorboard=True, save_tb_folder="tb")
    assert not (tmp_path / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- stragglers


def test_the_slowest_rank_is_the_one_with_the_largest_excess_over_the_others_median():
    from torchtitan.features.stragglers.stragglers import find_slowest

    busy = find_slowest([(0.1, 0.0), (0.1, 0.0), (0.5, 0.0), (0.1, 0.0)])  # slow after the last collective
    assert (busy.rank, round(busy.excess_s, 6), round(busy.spread, 6)) == (2, 0.4, 5.0)
    # slow input under FSDP: the others wait for it inside forward, so every busy time is alike; its data is not
    data = find_slowest([(0.5, 0.0), (0.5, 0.4), (0.5, 0.0)])
    assert (data.rank, round(data.excess_s, 6), round(data.spread, 6)) == (1, 0.4, 1.8)
    even = find_slowest([(0.1, 0.01), (0.1, 0.01)])
    assert even.excess_s == 0.0 and even.spread == 1.0


@pytest.mark.parametrize("factor", ["0.5", "1"])
def test_a_straggler_factor_of_one_or_less_is_refused(factor):
    from torchtitan.config.errors import ConfigError
    from torchtitan.config.manager import JobConfig
    from torchtitan.preflight import run_preflight

    config = JobConfig.parse_args(["--metrics.straggler_factor", factor])
    with pytest.raises(ConfigError, match=rf"metrics.straggler_factor = {float(factor)}: a straggler is slower"):
        run_preflight(config, 2)
    assert "no other rank to compare" in " ".join(
        run_preflight(JobConfig.parse_args(["--metrics.straggler_factor", "2"]), 1)
    )
