"""The estimator's table (torchtitan/estimation/report.py): columns stay apart whatever their text."""

from __future__ import annotations

import re
from types import SimpleNamespace

from torchtitan.estimation.estimate import Estimate, RoleEstimate
from torchtitan.estimation.report import GIB, format_table
from torchtitan.estimation.tracker import ROWS


def _role(role: str, phase: str, gib: float) -> RoleEstimate:
    memory = SimpleNamespace(
        breakdown={ROWS[0]: int(gib * GIB)}, peak=int(gib * GIB), peak_phase=phase, notes=[], phases={}
    )
    return RoleEstimate(role=role, rank=0, memory=memory)


def test_columns_never_run_together():
    roles = [_role("pp rank 0", "forward/backward", 29.46), _role("pp rank 1", "forward/backward", 1234.5)]
    table = format_table(Estimate(2, {"pp": 2}, "flavor", roles, seconds=1.0), "llama3 8B").splitlines()
    header, phases = table[1], next(line for line in table if line.startswith("peak falls in"))
    assert "forward/backwardforward/backward" not in phases
    assert re.split(r"\s{2,}", phases.strip()) == ["peak falls in", "forward/backward", "forward/backward"]
    assert re.split(r"\s{2,}", header.strip()) == ["GiB per rank at the peak", "pp rank 0", "pp rank 1"]
    # right-aligned columns: every value ends where its header ends
    ends = [m.end() for m in re.finditer(r"pp rank \d", header)]
    for line in table[2:5]:
        assert [m.end() for m in re.finditer(r"\S+", line)][-2:] == ends, line
