"""Fixtures shared by the integration modules (one single-process reference run per session), the
worker pools' lifetime (tests/support/pool.py), and the time report CI prints (docs/testing.md)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import time
from collections import defaultdict

import pytest

from tests.support import pool
from tests.support.golden import GoldenCheck, session_check
from tests.support.matrix import (
    BF16,
    DOCS,
    MOE,
    PURE_BF16,
    PURE_BF16_RTOL,
    MatrixLaunches,
    Row,
    losses_of,
    stored_dtypes,
)
from tests.support.runs import GLOBAL_BATCH, STEPS, VALIDATION, Launch, read_metrics, run_train, train


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess]:
    """One process, the whole global batch: (dump folder, the launcher's completed process).

    Through run_llama_train.sh (not the pool): tests/runs/launch/test_run_experience.py reads what the launcher printed."""
    folder = str(tmp_path_factory.mktemp("reference"))
    result = run_train(1, folder, ["--training.batch_size", str(GLOBAL_BATCH), *VALIDATION])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder, result


@pytest.fixture(scope="session")
def reference(reference_run) -> dict[str, list[float]]:
    folder, _ = reference_run
    records = read_metrics(folder)
    for key in ("step", "loss", "tps", "mfu", "memory_gib", "grad_norm", "lr"):
        assert key in records[0], key
    losses = losses_of(folder)
    assert losses["loss"][-1] < losses["loss"][0] - 0.3, f"loss did not fall: {losses['loss']}"
    return losses


@pytest.fixture(scope="session")
def bf16_reference(tmp_path_factory) -> dict[str, list[float]]:
    """The bf16 rows' reference: one process (so the trainer autocasts), the whole global batch."""
    folder = str(tmp_path_factory.mktemp("bf16_reference"))
    result = train(1, folder, ["--training.batch_size", str(GLOBAL_BATCH), *BF16])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return losses_of(folder)


@pytest.fixture(scope="session")
def pure_bf16_reference(tmp_path_factory, bf16_reference) -> dict[str, list[float]]:
    """The pure bf16 rows' reference: one process, bf16 parameters, the whole global batch. Its losses must miss
    the mixed-precision (fp32 weights) run's by more than the rows' tolerance: a run that ignored training.dtype
    would be that run."""
    folder = str(tmp_path_factory.mktemp("pure_bf16_reference"))
    result = train(1, folder, ["--training.batch_size", str(GLOBAL_BATCH), *PURE_BF16])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = losses_of(folder)
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses["loss"], bf16_reference["loss"], strict=True))
    assert gap > PURE_BF16_RTOL, f"pure bf16 is {gap:.2g} from mixed precision: training.dtype ignored?"
    assert stored_dtypes(os.path.join(folder, "checkpoint", f"step-{STEPS}")) == {"bfloat16"}
    return losses


@pytest.fixture(scope="session")
def moe_reference_run(tmp_path_factory) -> tuple[str, Launch]:
    """The MoE debug model on one process (a 1-rank pool job), the whole global batch: (dump folder, its run)."""
    folder = str(tmp_path_factory.mktemp("moe_reference"))
    result = train(1, folder, ["--training.batch_size", str(GLOBAL_BATCH), *MOE])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder, result


@pytest.fixture(scope="session")
def golden_run(tmp_path_factory) -> tuple[str, list[float]]:
    """The golden-loss run (tests/runs/training/test_golden_loss.py: the debug model, 100 steps through run_llama_train.sh, its
    step-100 checkpoint saved): (dump folder, its 100 losses). tests/runs/launch/test_generate_trained.py generates from it."""
    from tests.support.golden_run import train_losses

    folder = str(tmp_path_factory.mktemp("golden_run"))
    return folder, train_losses(folder)


@pytest.fixture(scope="session")
def golden(request) -> GoldenCheck:
    """The matrix's golden values (tests/support/golden.py); the terminal summary says how they were compared."""
    check = session_check()
    request.config.stash[_GOLDEN] = check
    return check


@pytest.fixture(scope="session")
def matrix(tmp_path_factory) -> MatrixLaunches:
    """The loss-parity rows: each runs in the worker pool of its world size when a test first asks."""
    return MatrixLaunches(str(tmp_path_factory.mktemp("matrix")))


def _docs_reference(folder: str, extra: list[str]) -> dict[str, list[float]]:
    """One process with block_causal on the short-document corpus; its losses and documents per window."""
    result = train(1, folder, ["--training.batch_size", str(GLOBAL_BATCH), *DOCS, *extra])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [r for r in read_metrics(folder) if "loss" in r]
    # every window holds boundaries, else block_causal would equal causal and prove nothing
    docs = [r["documents_per_window"] for r in records]
    assert min(docs) >= 2.0, f"windows of the short-document corpus hold too few documents: {docs}"
    assert all(r["mfu_attention"] == "visible_pairs" for r in records)
    assert "mfu(visible)" in result.stdout + result.stderr
    return {**losses_of(folder), "documents_per_window": docs}


@pytest.fixture(scope="session")
def docs_reference(tmp_path_factory) -> dict[str, list[float]]:
    return _docs_reference(str(tmp_path_factory.mktemp("docs_reference")), [])


@pytest.fixture(scope="session")
def docs_moe_reference(tmp_path_factory) -> dict[str, list[float]]:
    return _docs_reference(str(tmp_path_factory.mktemp("docs_moe_reference")), MOE)


# ---- worker pools: a world size is shut down once no collected test after this one needs it ----


def _world_sizes(item: pytest.Item) -> set[int]:
    """The pools a test uses, as far as its parameters and ``pool`` marker say.

    Only a hint for shutting pools down early: a pool a test uses without saying so is started on
    demand and closed after the next test that does not need it."""
    sizes: set[int] = set()
    if item.path.name == ESTIMATION_FILE:  # its rows are launches of its own (torchrun, the measure module): no pool
        return sizes
    if any(name.endswith(("reference", "reference_run")) for name in getattr(item, "fixturenames", ())):
        sizes.add(1)  # the single-process references are 1-rank pool jobs
    for marker in item.iter_markers("pool"):
        sizes.update(marker.args)
    params = item.callspec.params if hasattr(item, "callspec") else {}
    for name, value in params.items():
        if isinstance(value, Row):
            sizes.add(value.ngpu)
        elif name in ("world", "world_size", "ngpu") and isinstance(value, int):
            sizes.add(value)
    return sizes


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    # The estimator's file last: its real runs and estimates start at the lowest priority once collection is done
    # (pytest_collection_finish) and use the cores the rest of the session leaves idle.
    items.sort(key=lambda item: item.path.name == ESTIMATION_FILE)
    last: dict[int, int] = {}
    for index, item in enumerate(items):
        for size in _world_sizes(item):
            last[size] = index
    config.stash[_LAST_USE] = last
    config.stash[_INDEX] = {item.nodeid: i for i, item in enumerate(items)}


def pytest_collection_finish(session: pytest.Session) -> None:
    # Every module the tests import is loaded now and lives as long as the session: kept out of the collector's
    # full scans from here on (the pool's workers do the same, tests/support/pool.py)
    gc.freeze()
    selected = [item for item in session.items if item.path.name == ESTIMATION_FILE]
    if selected and not session.config.option.collectonly:
        selected[0].module.start_background(selected)
        session.config.stash[_BACKGROUND_MODULE] = selected[0].module


ESTIMATION_FILE = "test_estimation.py"
_LAST_USE = pytest.StashKey[dict]()
_INDEX = pytest.StashKey[dict]()
_BACKGROUND_MODULE = pytest.StashKey[object]()
_GOLDEN = pytest.StashKey[GoldenCheck]()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None:
        return  # the session's end closes every pool
    index = item.config.stash[_INDEX].get(item.nodeid, -1)
    last = item.config.stash[_LAST_USE]
    for size in pool.live_world_sizes():
        if last.get(size, -1) <= index:
            pool.close_pool(size, wait=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    pool.close_all()
    # the estimator's background is in sessions of its own (tests/support/background_priority.py): a Ctrl-C does not reach it
    module = session.config.stash.get(_BACKGROUND_MODULE, None)
    if module is not None:
        module.stop_background()


# ---- the time report: seconds per test file and per pool (what CI spends, docs/testing.md) ----

_FILE_SECONDS: dict[str, float] = defaultdict(float)
_FILE_TESTS: dict[str, int] = defaultdict(int)
_BF16_SECONDS: dict[str, float] = defaultdict(float)  # tests marked bf16: nodeid -> seconds
_BF16_MEASURED: dict[str, float] = {}  # those that report their bf16 steps' seconds (``bf16_seconds`` property)
# A Zen 3 (AVX2 only) ran a bf16 training step ~15x slower than fp32 (issue 43): the pessimistic bound below
# applies that to every bf16 second, as if no part of those tests were start-up or fp32.
ZEN3_BF16_SLOWDOWN = 15
# How much longer the bf16-marked tests take with an AVX2-only CPU's kernels: measured on an Intel Xeon with AMX,
# `pytest -m bf16` took 65 s, and 119 s with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (bf16 GEMMs ~60x
# slower there, more than a Zen 3's ~15x: a pessimistic factor). Their time is mostly start-up and fp32 work.
AVX2_BF16_TEST_FACTOR = 1.8
_SESSION_START = time.perf_counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] += report.duration  # setup (shared fixtures land on their first user), call, teardown
    if "bf16" in report.keywords:
        _BF16_SECONDS[report.nodeid] += report.duration
        measured = dict(report.user_properties).get("bf16_seconds")
        if measured is not None:  # the test timed its bf16 compute itself: the rest is start-up and fp32
            _BF16_MEASURED[report.nodeid] = measured
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _FILE_TESTS[path] += 1


def _write_bf16_time(write, total: float) -> None:
    """The seconds of the tests that compute in bf16 on purpose (marker bf16), and the wall time this run would
    take with an AVX2-only CPU's bf16 speed, all else equal (docs/testing.md): with these tests x1.8 (measured with
    AVX2 kernels), and, as a bound, with every bf16 second x15 (a Zen 3's bf16 step). A test that times its own bf16
    steps (the GPU check's dry run: ~6 of its ~20 s) counts those. Tests that are not about bf16 train in fp32."""
    bf16 = sum(_BF16_SECONDS.values())
    bf16_compute = bf16 + sum(seconds - _BF16_SECONDS[n] for n, seconds in _BF16_MEASURED.items())
    isa = torch_cpu_capability()
    write(
        f"bf16 tests (marker bf16): {len(_BF16_SECONDS)} tests, {bf16:.1f} s on this CPU (torch kernels: {isa}); "
        f"with an AVX2-only CPU's bf16 (these tests x{AVX2_BF16_TEST_FACTOR}, measured) this run would take "
        f"~{total + (AVX2_BF16_TEST_FACTOR - 1) * bf16:.0f} s; with their {bf16_compute:.1f} s of bf16 work x"
        f"{ZEN3_BF16_SLOWDOWN} at most ~{total + (ZEN3_BF16_SLOWDOWN - 1) * bf16_compute:.0f} s"
    )


def torch_cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _FILE_SECONDS:
        return
    write = terminalreporter.write_line
    golden = config.stash.get(_GOLDEN, None)
    if golden is not None:
        terminalreporter.section("golden parity values (tests/support/golden.py)")
        for line in golden.summary():
            write(line)
    terminalreporter.section("time per test file (setup + call + teardown)")
    total = time.perf_counter() - _SESSION_START
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        write(f"{seconds:8.1f} s  {_FILE_TESTS[path]:4d} tests  {path}")
    write(f"{sum(_FILE_SECONDS.values()):8.1f} s  {sum(_FILE_TESTS.values()):4d} tests  in tests ({total:.1f} s wall)")
    _write_bf16_time(write, total)
    stats = pool.STATS
    if not stats.jobs:
        return
    terminalreporter.section("worker pools (tests/support/pool.py): jobs and starts per world size")
    for size in sorted({j.world_size for j in stats.jobs} | set(stats.starts)):
        jobs = [j for j in stats.jobs if j.world_size == size]
        train = [j for j in jobs if j.name.startswith("train ")]
        write(
            f"world {size:2d}: {len(jobs):4d} jobs {sum(j.seconds for j in jobs):8.1f} s "
            f"({len(train)} trainer jobs {sum(j.seconds for j in train):7.1f} s), "
            f"{stats.starts.get(size, 0)} start(s) {stats.start_seconds.get(size, 0.0):5.1f} s, "
            f"{sum(size * j.seconds for j in jobs):8.1f} rank-seconds"
        )
    slowest = sorted(stats.jobs, key=lambda j: -j.seconds)[:15]
    write("slowest jobs: " + ", ".join(f"{j.name}@{j.world_size} {j.seconds:.1f}s" for j in slowest))
    if os.environ.get("TORCHTITAN_POOL_REPORT"):
        with open(os.environ["TORCHTITAN_POOL_REPORT"], "w") as f:
            json.dump([vars(j) for j in stats.jobs], f)
