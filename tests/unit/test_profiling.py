from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchtitan.observability.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling


def _train_steps(prof: torch.profiler.profile, first_step: int, last_step: int) -> None:
    x = torch.randn(16, 16)
    for _ in range(first_step, last_step + 1):
        x = torch.tanh(x @ x)
        prof.step()


def _traced_steps(trace_dir: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("iteration_")) for p in trace_dir.iterdir())


def test_trace_written_every_profile_freq_steps(tmp_path: Path) -> None:
    with maybe_enable_profiling(True, trace_dir=str(tmp_path), profile_freq=3) as prof:
        assert prof is not None
        _train_steps(prof, 1, 8)  # exiting mid-window after step 8 must not write a trace
    assert _traced_steps(tmp_path) == [3, 6]
    trace = json.loads((tmp_path / "iteration_3" / "rank0_trace.json").read_text())
    assert trace["traceEvents"]


def test_each_trace_records_profiler_active_steps(tmp_path: Path) -> None:
    """profiler_warmup = 0, profiler_active = 2 (torchtitan 2025's keys): training steps 2-3 and 5-6, each window
    named by its last step; the profiler numbers its steps from 0 (ProfilerStep#1 is training step 2)."""
    with maybe_enable_profiling(True, trace_dir=str(tmp_path), profile_freq=3, warmup=0, active=2) as prof:
        _train_steps(prof, 1, 7)
    assert _traced_steps(tmp_path) == [3, 6]
    for step, recorded in ((3, {"ProfilerStep#1", "ProfilerStep#2"}), (6, {"ProfilerStep#4", "ProfilerStep#5"})):
        trace = json.loads((tmp_path / f"iteration_{step}" / "rank0_trace.json").read_text())
        assert {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep")} == recorded
    with pytest.raises(ValueError, match="profile_freq must be >= 4"):
        with maybe_enable_profiling(True, trace_dir=str(tmp_path), profile_freq=3, warmup=3, active=1):
            pass


def test_resumed_run_traces_the_same_steps(tmp_path: Path) -> None:
    with maybe_enable_profiling(True, trace_dir=str(tmp_path), profile_freq=3, global_step=4, rank=2) as prof:
        _train_steps(prof, 5, 6)
    assert _traced_steps(tmp_path) == [6]
    assert (tmp_path / "iteration_6" / "rank2_trace.json").is_file()


def test_disabled_profiling_yields_none(tmp_path: Path) -> None:
    with maybe_enable_profiling(False, trace_dir=str(tmp_path), profile_freq=1) as prof:
        assert prof is None
    assert list(tmp_path.iterdir()) == []


def test_profile_freq_too_small(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="profile_freq"):
        with maybe_enable_profiling(True, trace_dir=str(tmp_path), profile_freq=1):
            pass


def test_memory_snapshot_off_cuda_is_refused(tmp_path: Path) -> None:
    kwargs = dict(snapshot_dir=str(tmp_path), profile_freq=2, device=torch.device("cpu"))
    with maybe_enable_memory_snapshot(False, **kwargs) as snapshotter:
        assert snapshotter is None
    with pytest.raises(NotImplementedError, match="memory snapshots need a CUDA device, not 'cpu'"):
        with maybe_enable_memory_snapshot(True, **kwargs):
            pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_snapshot_dumps_on_cuda(tmp_path: Path) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    with maybe_enable_memory_snapshot(True, snapshot_dir=str(tmp_path), profile_freq=2, device=device) as snapshotter:
        for _ in range(4):
            torch.ones(1024, device=device)
            snapshotter.step()
    assert _traced_steps(tmp_path) == [2, 4]
    assert (tmp_path / "iteration_2" / "rank0_memory_snapshot.pickle").stat().st_size > 0
