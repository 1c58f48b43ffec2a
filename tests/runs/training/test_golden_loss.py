"""The regression anchor: the debug model's first 100 steps against losses stored in tests/assets.

The parity matrix (tests/runs/training/test_parity_matrix.py) compares every layout with the single-process run,
so a change that alters that run itself (initialisation, data order, the loss, the optimizer, the
lr schedule) passes it. This test pins the single-process run: one process, fp32, deterministic,
100 steps of 4 x 64 tokens, each step's loss checked against GOLDEN_FILE within GOLDEN_RTOL.

Tolerance, from measurement (torch 2.13.0 CPU, Intel Xeon with AVX-512, these arguments): runs on
one machine give bit-identical losses (4 runs). Changing what differs between CPUs moves a step's
loss by at most, over the 100 steps (the gap grows slowly with the step): 1 instead of 2 OpenMP
threads 2.2e-7 relative; AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``,
``ONEDNN_MAX_CPU_ISA=AVX2``) on 1 thread 3.0e-7; no vectorisation (``default``, ``SSE4_2``,
``SSE41``) 6.5e-7. GOLDEN_RTOL = 1e-5 leaves 15x over the worst of these for other CPUs' BLAS.
A real change to the numerics fails it: a learning rate 0.1% higher from step 5 (4e-3 by the
end), a different seed at step 1.

The run (tests/support/golden_run.py) also saves its step-100 checkpoint (``SAVE``: no effect on the losses): tests/runs/launch/test_generate_trained.py
generates from it instead of training the debug model a second time. The run is the session fixture
``golden_run`` (tests/conftest.py), made by whichever of the two files runs first.

Regenerate after an intended change of the reference (say why in the commit):
``TORCHTITAN_REGENERATE_GOLDEN=1 python -m pytest tests/runs/training/test_golden_loss.py`` rewrites the file
and warns with the largest change; review the diff before committing it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import warnings

import pytest
import torch

from tests.support.golden_run import ARGS, command
from tests.support.runs import ROOT

pytestmark = pytest.mark.integration

GOLDEN_FILE = os.path.join(ROOT, "tests", "assets", "golden_loss_debug_100.json")
GOLDEN_RTOL = 1e-5
REGENERATE_ENV = "TORCHTITAN_REGENERATE_GOLDEN"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def relative_gaps(got: list[float], want: list[float]) -> list[float]:
    return [abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)]


def write_golden(losses: list[float]) -> None:
    golden = {
        "about": "per-step training loss of the debug model, checked by tests/runs/training/test_golden_loss.py",
        "command": command(),
        "args": ARGS,
        "torch": torch.__version__,
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "generated": datetime.date.today().isoformat(),
        "regenerate": f"{REGENERATE_ENV}=1 python -m pytest tests/runs/training/test_golden_loss.py",
        "losses": losses,
    }
    with open(GOLDEN_FILE, "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")


def announce_regenerated(losses: list[float]) -> None:
    """Say loudly that the reference changed, and by how much."""
    change = "no previous file"
    if os.path.isfile(GOLDEN_FILE):
        with open(GOLDEN_FILE) as f:
            gaps = relative_gaps(losses, json.load(f)["losses"])
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        change = f"largest change {gaps[worst]:.3g} relative at step {worst + 1}"
    note = (
        f"\n{'#' * 78}\n# GOLDEN LOSS REFERENCE REWRITTEN: {os.path.relpath(GOLDEN_FILE, ROOT)}\n"
        f"# {change}\n# Review the diff; commit it only for an intended change of the numerics.\n{'#' * 78}\n"
    )
    warnings.warn(note, stacklevel=2)


def test_debug_model_matches_golden_losses(golden_run):
    _, losses = golden_run
    if os.environ.get(REGENERATE_ENV) == "1":
        announce_regenerated(losses)
        write_golden(losses)
        return
    with open(GOLDEN_FILE) as f:
        golden = json.load(f)
    assert golden["args"] == ARGS, (
        f"{GOLDEN_FILE} was made with other arguments; regenerate it ({golden['regenerate']})"
    )
    gaps = relative_gaps(losses, golden["losses"])
    bad = [i for i, gap in enumerate(gaps) if gap > GOLDEN_RTOL]
    assert not bad, (
        f"{len(bad)} of 100 losses differ from the golden file by more than {GOLDEN_RTOL} relative; "
        f"first at step {bad[0] + 1}: {losses[bad[0]]!r} vs {golden['losses'][bad[0]]!r}; largest {max(gaps):.3g}. "
        f"The reference was made with torch {golden['torch']} on {golden['cpu']}. If the change is intended, "
        f"regenerate it: {golden['regenerate']}"
    )
