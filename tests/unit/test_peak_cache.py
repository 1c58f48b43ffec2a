"""The CPU peak cache keeps only plausible numbers: a poisoned entry is measured again, with one log line.

(The same through the command a user types: tests/runs/launch/test_peak_cache_runs.py.)
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from torchtitan.observability import flops, peak_cache
from torchtitan.observability.flops import LinearShape, get_peak_flops, measure_matmul_flops
from torchtitan.observability.peak_cache import CEILING_PER_THREAD, cpu_cache_key, why_implausible

CPU = torch.device("cpu")
GFLOPS = 1e9
METHOD = "fastest GEMM FLOP/s of 3 passes"


def _key(*gemms: tuple[str, int, int, int], dtype: torch.dtype = torch.float32) -> str:
    return cpu_cache_key(METHOD, dtype, gemms)


# three shapes measured on a quiet machine, and the issue's: 1.48 GFLOP/s against 180-200
SMALL, MEDIUM, LARGE = ("NT", 64, 64, 256), ("NT", 128, 64, 2304), ("NT", 512, 256, 2304)
NEIGHBOURS = {_key(SMALL): 180 * GFLOPS, _key(("NT", 128, 64, 256)): 200 * GFLOPS, _key(MEDIUM): 190 * GFLOPS}


def test_a_number_far_under_its_no_larger_neighbours_is_implausible() -> None:
    threads = torch.get_num_threads()
    why = why_implausible(_key(LARGE), 1.48 * GFLOPS, NEIGHBOURS, threads=threads)
    assert why == "1.48 GFLOP/s is under 1/4 of the 190 GFLOP/s that 3 entries with no larger GEMMs hold"
    assert why_implausible(_key(LARGE), 190 * GFLOPS, NEIGHBOURS, threads=threads) is None
    assert why_implausible(_key(LARGE), 48 * GFLOPS, NEIGHBOURS, threads=threads) is None  # 1/4 of 190 = 47.5
    assert why_implausible(_key(LARGE), 47 * GFLOPS, NEIGHBOURS, threads=threads) is not None
    # its own old number is no neighbour of a new measurement
    assert why_implausible(_key(MEDIUM), 50 * GFLOPS, {_key(MEDIUM): 1.48 * GFLOPS}, threads=threads) is None


def test_larger_shapes_other_dtypes_and_other_methods_are_no_bound() -> None:
    threads = torch.get_num_threads()
    # bf16 on AMX: small GEMMs at 381 GFLOP/s against 1275 for larger ones, both right
    assert why_implausible(_key(SMALL), 381 * GFLOPS, {_key(LARGE): 1275 * GFLOPS}, threads=threads) is None
    others = {
        _key(SMALL, dtype=torch.bfloat16): 900 * GFLOPS,
        _key(SMALL).replace(METHOD, "another method"): 900 * GFLOPS,
        _key(SMALL).split("|", 1)[1]: 900 * GFLOPS,  # the format before the method was named
    }
    assert why_implausible(_key(LARGE), 1.48 * GFLOPS, others, threads=threads) is None


@pytest.mark.parametrize("value", ["fast", True, -1.0, 0, math.nan, math.inf, None])
def test_a_non_number_is_implausible(value: object) -> None:
    assert why_implausible(_key(LARGE), value, {}, threads=1) == f"{value!r} is not a positive number"


def test_a_number_above_the_ceiling_is_implausible() -> None:
    assert why_implausible(_key(LARGE), 0.9 * CEILING_PER_THREAD, {}, threads=1) is None
    why = why_implausible(_key(LARGE), 1.5 * CEILING_PER_THREAD, {}, threads=1)
    assert why == "1.5e+04 GFLOP/s is above 1 x 10 TFLOP/s, more than any CPU does at 1 threads"
    assert why_implausible(_key(LARGE), 1.5 * CEILING_PER_THREAD, {}, threads=2) is None


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "torchtitan" / "peak_flops.json"


LINEARS = (LinearShape(512, 256, 2304),)


def _seed_cache(path: Path, run_value: object) -> tuple[str, dict[str, object]]:
    """A cache holding the run's key at `run_value` and two no-larger neighbours at 190 GFLOP/s; (key, entries)."""
    key = flops._cpu_cache_key(torch.float32, LINEARS)
    entries = {
        key: run_value,
        flops._cpu_cache_key(torch.float32, (LinearShape(64, 64, 64),)): 190 * GFLOPS,
        flops._cpu_cache_key(torch.float32, (LinearShape(128, 64, 256),)): 190 * GFLOPS,
    }
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(entries))
    return key, entries


def _measure_as(monkeypatch: pytest.MonkeyPatch, value: float) -> list[torch.dtype]:
    calls: list[torch.dtype] = []

    def fake_measure(device: torch.device, dtype: torch.dtype, linears: object) -> float:
        calls.append(dtype)
        return value

    monkeypatch.setattr(flops, "measure_matmul_flops", fake_measure)
    return calls


@pytest.mark.parametrize("poison", [1.48 * GFLOPS, "1.9e11", -1.0], ids=["implausible", "string", "negative"])
def test_a_poisoned_entry_is_measured_again_with_one_line_and_rewritten(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, poison: object
) -> None:
    key, entries = _seed_cache(cache_home, poison)
    calls = _measure_as(monkeypatch, 185 * GFLOPS)
    with caplog.at_level(logging.INFO, logger="torchtitan.observability"):
        peak = get_peak_flops(CPU, torch.float32, linears=LINEARS)
    assert calls == [torch.float32] and peak.flops == 185 * GFLOPS
    assert peak.cached == peak_cache.CacheEntry(cache_home, key)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and caplog.records[0].levelno == logging.WARNING, lines
    assert lines[0].startswith(f"not using the CPU peak cached in {cache_home}: ")
    assert "; re-measured CPU peak 185.0 GFLOP/s (fp32, " in lines[0] and lines[0].endswith(f"cached in {cache_home}")
    assert json.loads(cache_home.read_text()) == {**entries, key: 185 * GFLOPS}
    # the next run believes it
    _measure_as(monkeypatch, 0.0)
    assert get_peak_flops(CPU, torch.float32, linears=LINEARS).flops == 185 * GFLOPS


def test_an_implausible_measurement_is_used_but_not_cached(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The machine is busy now too: the run divides by what it measured; the cache keeps what it had.
    _, entries = _seed_cache(cache_home, 1.48 * GFLOPS)
    _measure_as(monkeypatch, 3 * GFLOPS)
    with caplog.at_level(logging.INFO, logger="torchtitan.observability"):
        peak = get_peak_flops(CPU, torch.float32, linears=LINEARS)
    assert peak.flops == 3 * GFLOPS and peak.cached is None and peak.source.endswith("not cached (implausible)")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "re-measured CPU peak 3.0 GFLOP/s" in lines[0], lines
    assert lines[0].endswith(
        "190 GFLOP/s that 2 entries with no larger GEMMs hold: not cached, the next run measures again"
    )
    assert json.loads(cache_home.read_text()) == entries


def test_an_entry_of_the_old_format_is_not_reused(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before the method was named, a key began with the CPU's name and held one pass's number.
    old_key = flops._cpu_cache_key(torch.float32, LINEARS).split("|", 1)[1]
    cache_home.parent.mkdir(parents=True)
    cache_home.write_text(json.dumps({old_key: 1.48 * GFLOPS}))
    calls = _measure_as(monkeypatch, 185 * GFLOPS)
    assert get_peak_flops(CPU, torch.float32, linears=LINEARS).flops == 185 * GFLOPS and calls == [torch.float32]
    entries = json.loads(cache_home.read_text())
    assert entries[old_key] == 1.48 * GFLOPS  # left alone: an older checkout may share the file
    assert entries[flops._cpu_cache_key(torch.float32, LINEARS)] == 185 * GFLOPS


def test_the_cache_key_names_the_method() -> None:
    key = flops._cpu_cache_key(torch.float32, LINEARS)
    assert key.startswith(f"fastest GEMM FLOP/s of {flops.PASSES} passes|{peak_cache.cpu_model_name()}|threads=")


def test_an_entry_is_dropped_only_if_it_still_holds_the_number(cache_home: Path) -> None:
    key, entries = _seed_cache(cache_home, 1.48 * GFLOPS)
    entry = peak_cache.CacheEntry(cache_home, key)
    assert not peak_cache.drop_entry(entry, 2 * GFLOPS)  # another run measured it again since
    assert peak_cache.drop_entry(entry, 1.48 * GFLOPS)
    assert json.loads(cache_home.read_text()) == {k: v for k, v in entries.items() if k != key}


def _fake_timings(monkeypatch: pytest.MonkeyPatch, seconds: list[float]) -> list[bool]:
    """`_time_gemm` returning `seconds` call by call; the `warm_up` of each call."""
    times, warm_ups = iter(seconds), []

    def fake_time(a: torch.Tensor, b: torch.Tensor, budget_s: float, give_up_s: float, *, warm_up: bool):
        warm_ups.append(warm_up)
        return next(times), 5

    monkeypatch.setattr(flops, "_time_gemm", fake_time)
    return warm_ups


TINY = (LinearShape(8, 8, 8),)  # three GEMMs of 2 * 8^3 FLOPs: NT, NN and TN


def test_the_measurement_keeps_the_fastest_of_its_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    # A burst of load slows the first pass; NN is quiet in the second; the third times only NN (NT and
    # TN are under half its rate), half as fast.
    warm_ups = _fake_timings(monkeypatch, [1.0, 1.0, 1.0, 0.5, 0.01, 0.5, 0.02])
    assert measure_matmul_flops(CPU, torch.float32, TINY, budget_s=10.0, passes=3) == 2 * 8**3 / 0.01
    assert warm_ups == [True] * 3 + [False] * 4  # one untimed call per GEMM, in the first pass


def test_a_gemm_that_takes_the_whole_budget_is_not_timed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # NT's first call takes 2 s of a 0.5 s budget (a slow kernel): NN and TN only in passes 2 and 3.
    warm_ups = _fake_timings(monkeypatch, [2.0, 0.1, 0.1, 0.1, 0.05, 0.1, 0.1])
    assert measure_matmul_flops(CPU, torch.float32, TINY, budget_s=0.5, passes=3) == 2 * 8**3 / 0.05
    assert len(warm_ups) == 7
