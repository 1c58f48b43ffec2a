"""``training.cpu_malloc``: which processes get glibc malloc's thresholds, the refusal without glibc, and (in a process
of its own) that the thresholds do keep a step's freed pages: a second pass over the same allocations faults them
in again under glibc's defaults and not once tuned."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from torchtitan.distributed.backend import host_malloc


@pytest.fixture
def calls(monkeypatch):
    made: list[tuple[int, int]] = []
    monkeypatch.setattr(host_malloc, "_mallopt", lambda: lambda option, value: made.append((option, value)) or 1)
    for name in host_malloc.user_malloc_settings():
        monkeypatch.delenv(name, raising=False)
    return made


TUNED = [(host_malloc.M_MMAP_THRESHOLD, 32 << 20), (host_malloc.M_TRIM_THRESHOLD, 1 << 30)]


def test_auto_tunes_a_cpu_process_with_several_threads_only(calls):
    assert host_malloc.tune_cpu_malloc("auto", "cpu", 2) and calls == TUNED
    calls.clear()
    assert not host_malloc.tune_cpu_malloc("auto", "cpu", 1)  # one thread per rank: no contention to save
    assert not host_malloc.tune_cpu_malloc("auto", "cuda", 8)
    assert not host_malloc.tune_cpu_malloc("system", "cpu", 2)
    assert calls == []
    assert host_malloc.tune_cpu_malloc("tuned", "cuda", 1) and calls == TUNED


@pytest.mark.parametrize(
    "name, value",
    [("MALLOC_ARENA_MAX_", "2"), ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"), ("LD_PRELOAD", "libjemalloc.so")],
)
def test_auto_leaves_the_environments_own_malloc_settings(calls, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert not host_malloc.tune_cpu_malloc("auto", "cpu", 2) and calls == []
    assert host_malloc.tune_cpu_malloc("tuned", "cpu", 2) and calls == TUNED  # asked for: set


def test_tuned_without_glibc_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(host_malloc, "_mallopt", lambda: None)
    assert not host_malloc.tune_cpu_malloc("auto", "cpu", 2)
    with pytest.raises(
        ValueError, match=r"training.cpu_malloc = 'tuned' sets glibc malloc's thresholds.*auto or system"
    ):
        host_malloc.tune_cpu_malloc("tuned", "cpu", 2)


PASSES = """
import json, resource, sys, torch
from torchtitan.distributed.backend.host_malloc import tune_cpu_malloc
tuned = tune_cpu_malloc(sys.argv[1], "cpu", 2)
torch.ones(8 << 20)  # a 32 MiB block, mapped and unmapped: glibc's dynamic thresholds rise to their caps, 32 / 64 MiB
def one_pass():  # a step's pattern: 40 blocks of 4 MiB (from the heap) touched, then all freed
    blocks = [torch.ones(1 << 20) for _ in range(40)]
    del blocks
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    one_pass()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"tuned": tuned, "faults": faults}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
def test_tuned_thresholds_keep_the_freed_pages_of_a_pass():
    def passes(mode: str) -> dict:
        out = subprocess.run([sys.executable, "-c", PASSES, mode], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    pages = 40 * (4 << 20) // 4096  # one pass's
    system, tuned = passes("system"), passes("tuned")
    assert not system["tuned"] and tuned["tuned"]
    # glibc's defaults: the heap's free top (160 MiB) passes the trim threshold (64 MiB) and goes back to the kernel,
    # so the next pass faults its pages in again (every pass, or the next one or two: the heap's layout decides;
    # measured 42-164 k faults over passes 2-5)
    assert sum(system["faults"][1:]) > pages, system
    # tuned: the later passes reuse the first pass's pages (measured 5-8 k faults over passes 2-5)
    assert sum(tuned["faults"][1:]) < pages // 4, tuned
