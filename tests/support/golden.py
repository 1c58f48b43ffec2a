"""Golden values of the loss-parity matrix: each row's and reference's logged numbers, bit for bit.

The matrix (tests/runs/training/test_parity_matrix.py) compares every layout with one process within a tolerance, so a
change that moves all runs alike, or moves one by less than the tolerance, passes it. GOLDEN_FILE pins
what the code logged in metrics.jsonl before the trainer's refactor: per machine fingerprint (torch
version, the kernels torch picked, the CPU's ISA flags, the thread count a one-process run gets), each
row's per-step loss, grad norm and validation loss. The check rides on the runs the matrix makes
anyway. A row is compared:

* exactly (``==`` on the floats as logged) where this machine's fingerprint is recorded;
* within the matrix's own tolerances elsewhere: other CPU kinds and torch versions round differently.
  The session says so once (a warning, and a line in the terminal summary);
* within the tolerances everywhere if the file lists it under ``rtol_rows``, with the reason it is not
  reproducible bit for bit from run to run.

A row with no golden values fails: a new row must be recorded. To record, set RECORD_ENV to a path:
``TORCHTITAN_GOLDEN_RECORD=tests/assets/golden_parity.json python -m pytest tests/runs/training/test_parity_matrix.py``
writes each row's observed values under this machine's fingerprint into that file, merged into what it
holds, and still compares against GOLDEN_FILE where it has this fingerprint (it is read once, before any
row runs). Review the diff and say why in the commit.
"""

from __future__ import annotations

import datetime
import json
import os
import warnings
from dataclasses import dataclass, field

GOLDEN_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "golden_parity.json")
RECORD_ENV = "TORCHTITAN_GOLDEN_RECORD"
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # .ci/run's ISA line
RECORD_HINT = f"{RECORD_ENV}=tests/assets/golden_parity.json python -m pytest tests/runs/training/test_parity_matrix.py"

# A row's values: key ("loss", "grad_norm", "validation_loss") -> step -> value as logged.
Values = dict[str, dict[int, float]]


def isa_flags() -> list[str]:
    """The CPU flags among ISA_FLAGS (the kernels oneDNN and torch may pick), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return []
    return sorted(set(line.split(":", 1)[-1].split()) & set(ISA_FLAGS))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def fingerprint() -> str:
    """What sets the bits besides the code: torch, its kernels, the ISA, a one-process run's threads.

    The pool's ranks run 1 thread each; the dense reference runs through torchrun with the default."""
    import torch

    isa = " ".join(isa_flags()) or "none"
    return (
        f"torch {torch.__version__}; kernels {torch.backends.cpu.get_cpu_capability()}; isa {isa}; "
        f"{torch.get_num_threads()} threads"
    )


@dataclass(frozen=True)
class Golden:
    """GOLDEN_FILE's contents: values per fingerprint and row, and the rows compared at tolerance only."""

    rows: dict[str, dict[str, Values]] = field(default_factory=dict)  # fingerprint -> row -> values
    rtol_rows: dict[str, str] = field(default_factory=dict)  # row -> why it is not bit-reproducible


def load_golden(path: str = GOLDEN_FILE) -> Golden:
    if not os.path.isfile(path):
        return Golden()
    with open(path) as f:
        data = json.load(f)
    rows = {
        fp: {name: _values_from_json(values) for name, values in entry["rows"].items()}
        for fp, entry in data.get("fingerprints", {}).items()
    }
    return Golden(rows, dict(data.get("rtol_rows", {})))


def _values_from_json(values: dict[str, dict[str, float]]) -> Values:
    return {key: {int(step): v for step, v in steps.items()} for key, steps in values.items()}


def record(path: str, here: str, name: str, values: Values) -> None:
    """Write ``values`` as row ``name`` under fingerprint ``here`` into ``path``, keeping its other rows."""
    data = {"about": __doc__.split("\n")[0], "record": RECORD_HINT, "rtol_rows": {}, "fingerprints": {}}
    if os.path.isfile(path):
        with open(path) as f:
            data = json.load(f)
    entry = data["fingerprints"].setdefault(here, {"cpu": cpu_model(), "rows": {}})
    entry["recorded"] = datetime.date.today().isoformat()
    entry["rows"][name] = {key: {str(step): v for step, v in steps.items()} for key, steps in values.items()}
    entry["rows"] = dict(sorted(entry["rows"].items()))
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def compare(name: str, key: str, got: dict[int, float], want: dict[int, float], rtol: float | None) -> None:
    """Fail unless every step's value equals the golden one (``rtol`` None) or is within ``rtol`` of it."""
    how = "exactly" if rtol is None else f"within relative {rtol:g}"
    assert sorted(got) == sorted(want), f"golden {name}: {key} logged at steps {sorted(got)}, golden {sorted(want)}"
    for step in sorted(want):
        g, w = got[step], want[step]
        ok = g == w if rtol is None else abs(g - w) <= rtol * abs(w)
        assert ok, f"golden {name}: {key} at step {step}: got {g!r}, golden {w!r} (compared {how})"


class GoldenCheck:
    """The session's comparisons against one Golden, on the machine whose fingerprint is ``here``."""

    def __init__(self, golden: Golden, *, here: str, record_path: str | None = None):
        self.golden = golden
        self.here = here
        self.record_path = record_path
        self.exact: list[str] = []
        self.tolerance: list[str] = []  # rows of this fingerprint in golden.rtol_rows
        self.elsewhere: list[str] = []  # rows compared against another fingerprint's values
        self.recorded: list[str] = []

    def check(self, name: str, values: Values, rtol: dict[str, float]) -> None:
        """Record row ``name``'s values if asked, then compare them with the golden ones.

        ``rtol`` is the row's tolerance per key, used where exactness does not apply."""
        if self.record_path:
            record(self.record_path, self.here, name, values)
            self.recorded.append(name)
        want, exact = self._golden_of(name)
        if want is None:
            return
        for key in sorted(set(want) | set(values)):
            compare(name, key, values.get(key, {}), want.get(key, {}), None if exact else rtol[key])

    def _golden_of(self, name: str) -> tuple[Values | None, bool]:
        """The golden values of row ``name`` and whether they are compared exactly."""
        mine = self.golden.rows.get(self.here, {})
        if name in mine:
            exact = name not in self.golden.rtol_rows
            (self.exact if exact else self.tolerance).append(name)
            return mine[name], exact
        others = [rows[name] for rows in self.golden.rows.values() if name in rows]
        if not others:
            assert self.record_path, f"golden {name}: no golden values in {GOLDEN_FILE}; record them: {RECORD_HINT}"
            return None, False
        if not self.elsewhere:
            warnings.warn(f"golden parity values: {self.not_exact_note()}", stacklevel=3)
        self.elsewhere.append(name)
        return others[0], False

    def not_exact_note(self) -> str:
        known = "; ".join(f"[{fp}]" for fp in self.golden.rows) or "none"
        return (
            f"this machine's fingerprint [{self.here}] is not recorded (recorded: {known}): "
            "rows are compared within the matrix's tolerances, exactness was not checked"
        )

    def summary(self) -> list[str]:
        """Lines for the terminal summary: what was compared how, and what was recorded."""
        lines = [f"golden parity values, fingerprint [{self.here}]: {len(self.exact)} rows bit-exact"]
        if self.tolerance:
            lines.append(f"  {len(self.tolerance)} rows within tolerance by design (rtol_rows): {self.tolerance}")
        if self.elsewhere:
            lines.append(f"  {len(self.elsewhere)} rows within tolerance only: {self.not_exact_note()}")
        if self.recorded:
            lines.append(f"  recorded {len(self.recorded)} rows into {self.record_path}")
        return lines


def session_check() -> GoldenCheck:
    """The check of a test session: GOLDEN_FILE on this machine, recording where RECORD_ENV says."""
    return GoldenCheck(load_golden(), here=fingerprint(), record_path=os.environ.get(RECORD_ENV) or None)


def values_of(losses: dict[str, list[float]], val_freq: int) -> Values:
    """A row's golden values from its per-step lists (tests/support/matrix.py ``losses_of``): training steps
    count from 1, validation runs every ``val_freq`` steps."""
    return {
        "loss": dict(enumerate(losses["loss"], 1)),
        "grad_norm": dict(enumerate(losses["grad_norm"], 1)),
        "validation_loss": {i * val_freq: v for i, v in enumerate(losses["validation_loss"], 1)},
    }
