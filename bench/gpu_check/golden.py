"""bench/gpu_check's golden files: each run row's tokens/s and peak memory against the figures stored for this
device kind (bench/golden/<kind>.json), so a row that got slower or hungrier is marked in the report instead of
drifting silently.

Pure functions over the report's JSON records (no torch): ``device_kind`` names the file, ``load_golden`` reads
it, ``compare_row`` / ``compare_rows`` give each row its verdict, ``summarize`` writes the report's ``golden``
section and ``record_golden`` the file a run records (``--record-golden``). docs/performance.md says how to read
and record them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
# The sections whose runs are training rows with tokens/s and peak memory (sanity and the estimator are not).
RUN_SECTIONS = (
    "throughput",
    "float8",
    "attention",
    "families",
    "linear_attention",
    "features",
    "compile",
    "rl",
    "checkpoint",
    "levers",
    "width_8b",
)
DRY_RUN_KIND = "cpu_dry_run"

OK, REGRESSED, IMPROVED = "ok", "REGRESSED", "improved"
# NEW: a measured row the golden file has no figures for (added since the file was recorded): shown, never a failure
NEW, CHANGED, NOT_MEASURED, MISSING = "no golden value yet", "config changed", "not measured", "missing"

# GPU name -> kind, first match wins (as torchtitan/observability/flops.py's peak table): a name that contains
# another comes first. Form factors are kinds of their own: an H100 PCIe's bf16 peak is 76% of the SXM's, so
# it must not be compared with the SXM's figures. Any other GPU: its whole name as a slug (a file of its own).
GPU_KINDS = (
    ("GH200", "gh200"),
    ("H200 NVL", "h200_nvl"),
    ("H200", "h200"),
    ("H100 NVL", "h100_nvl"),
    ("H100 PCIe", "h100_pcie"),
    ("H100", "h100"),  # the SXM: "NVIDIA H100 80GB HBM3"
    ("GB200", "gb200"),
    ("B200", "b200"),
)


@dataclass(frozen=True)
class Tolerance:
    tps_rtol: float  # tokens/s may fall to golden x (1 - tps_rtol) before the row counts as regressed
    memory_rtol: float | None  # peak memory may grow to golden x (1 + memory_rtol); None: memory not measured
    why: str


# A row recorded for the first time gets its kind's default; each file states its own per row after that.
DRY_RUN_TOLERANCE = Tolerance(
    tps_rtol=0.98,
    memory_rtol=None,
    why="CPU dry run, 5 timed steps of ~35 ms on one thread of a shared 2-core machine: three dry runs on one Xeon "
    "(load 1-3) differed up to 17x on a row, and CI's CPU kinds (EPYC Zen 3 AVX2-only, Xeon AMX) up to 10x more, "
    "so only a >50x drop (a stall, like the 70x of spinning OpenMP threads) reads as regressed: the verdict shows "
    "that the comparison runs, it does not measure speed. Peak memory is null on the CPU: not compared",
)
GPU_TOLERANCE = Tolerance(
    tps_rtol=0.05,
    memory_rtol=0.01,
    why="the two recorded H100 runs agreed within 0.1-2.8% on the 1B seq 2048 rows, 1B eager seq 8192, causal and "
    "FlexAttention seq 8192 and both float8 rows, so 5% is over that noise (the rows that moved more carry a "
    "note); peak memory (max_memory_allocated) was equal to 0.01 GiB in both runs on every row",
)


@dataclass(frozen=True)
class Golden:
    """The golden file of one device kind; ``data`` None where there is none (or ``error`` where it does not read)."""

    kind: str
    path: Path
    data: dict[str, Any] | None
    error: str | None = None

    @property
    def rows(self) -> dict[str, dict[str, Any]]:
        return {} if self.data is None else self.data["rows"]


def device_kind(gpu_name: str | None, *, dry_run: bool, device_type: str) -> str:
    """The golden file's name for this device: 'cpu_dry_run', a kind from ``GPU_KINDS``, else a slug of the name."""
    if dry_run:
        return DRY_RUN_KIND
    if not gpu_name:
        return device_type
    for needle, kind in GPU_KINDS:
        if needle in gpu_name:
            return kind
    return re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_")


def default_tolerance(kind: str) -> Tolerance:
    return DRY_RUN_TOLERANCE if kind == DRY_RUN_KIND else GPU_TOLERANCE


def record_command(golden: Golden) -> str:
    """The command that records ``golden``'s file: this kind's check with --record-golden."""
    dry = " --cpu-dry-run" if golden.kind == DRY_RUN_KIND else ""
    folder = "" if golden.path.parent == GOLDEN_DIR else f" --golden-dir {golden.path.parent}"
    return f"python -m bench.gpu_check{dry} --out OUT --record-golden{folder}"


def display_path(path: Path) -> str:
    """``path`` relative to the repository root where it lies inside it (as the report names it)."""
    try:
        return str(path.resolve().relative_to(GOLDEN_DIR.parents[1]))
    except ValueError:
        return str(path)


def load_golden(kind: str, folder: Path = GOLDEN_DIR) -> Golden:
    """``folder/<kind>.json``; a file that does not exist or does not read is recorded, never raised."""
    path = folder / f"{kind}.json"
    if not path.exists():
        return Golden(kind, path, None)
    try:
        data = json.loads(path.read_text())
        check_golden(data, path)
    except (ValueError, OSError) as e:  # json.JSONDecodeError is a ValueError
        return Golden(kind, path, None, error=f"{type(e).__name__}: {e}")
    return Golden(kind, path, data)


def check_golden(data: dict[str, Any], path: Path) -> None:
    """Raise ValueError naming the file, the row and the key of the first entry a comparison could not use."""
    if not isinstance(data.get("rows"), dict):
        raise ValueError(f"{display_path(path)}: no 'rows' object; a golden file has {{'rows': {{name: row}}}}")
    for name, row in data["rows"].items():
        where = f"{display_path(path)} row '{name}'"
        for key in ("tokens_per_s", "peak_memory_gib"):
            if row.get(key) is not None and not (isinstance(row[key], (int, float)) and row[key] > 0):
                raise ValueError(f"{where}: {key} = {row[key]!r}; allowed: a positive number or null")
        if not (isinstance(row.get("tps_rtol"), (int, float)) and 0 <= row["tps_rtol"] < 1):
            raise ValueError(f"{where}: tps_rtol = {row.get('tps_rtol')!r}; allowed: a number in [0, 1)")
        memory_rtol = row.get("memory_rtol")
        if row.get("peak_memory_gib") is not None and not (isinstance(memory_rtol, (int, float)) and memory_rtol >= 0):
            raise ValueError(
                f"{where}: memory_rtol = {memory_rtol!r} with a peak_memory_gib; allowed: a number >= 0 "
                "(null only where peak_memory_gib is null)"
            )
        if not isinstance(row.get("why"), str) or not row["why"]:
            raise ValueError(f"{where}: no 'why'; each row states why its tolerance is what it is")


# ----------------------------------------------------------------------------------------------- comparison


def compare_row(run: dict[str, Any], row: dict[str, Any] | None) -> dict[str, Any]:
    """One run row against its golden row: the verdict and, per measure, the ratio and the band it had to be in."""
    if run["status"] != "ok":
        reason = {"skipped": "the run was skipped", "error": "the run failed"}.get(run["status"], run["status"])
        return {"verdict": NOT_MEASURED, "reason": reason}
    if row is None:
        return {"verdict": NEW}
    changed = {k: [v, run.get(k)] for k, v in row.get("spec", {}).items() if _json(run.get(k)) != v}
    if changed:  # the numbers describe another config: comparing them would mislead either way
        return {"verdict": CHANGED, "changed": changed}
    checks = {
        "tokens_per_s": _check(
            run.get("tokens_per_s"), row["tokens_per_s"], _tps_band(row["tps_rtol"]), lower_bad=True
        ),
        "peak_memory_gib": _check(
            run.get("peak_memory_gib"), row["peak_memory_gib"], _memory_band(row.get("memory_rtol")), lower_bad=False
        ),
    }
    verdicts = [c["verdict"] for c in checks.values() if c is not None]
    verdict = REGRESSED if REGRESSED in verdicts else IMPROVED if IMPROVED in verdicts else OK
    note = {"note": row["note"]} if row.get("note") else {}
    return {"verdict": verdict, **{k: c for k, c in checks.items() if c is not None}, **note}


def compare_rows(runs: Sequence[dict[str, Any]], rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every run row's verdict by name (a row another section reuses is the same run: one verdict)."""
    return {run["name"]: compare_row(run, rows.get(run["name"])) for run in runs}


def _tps_band(rtol: float) -> tuple[float, float]:
    # symmetric on a log scale: a 0.98 tolerance allows x0.02 to x50, a 0.05 one x0.95 to x1.053
    return (1 - rtol, 1 / (1 - rtol))


def _memory_band(rtol: float | None) -> tuple[float, float] | None:
    return None if rtol is None else (1 / (1 + rtol), 1 + rtol)


def _check(got: float | None, want: float | None, band: tuple[float, float] | None, *, lower_bad: bool) -> Any:
    """The ratio got / want against ``band``; None where either side (or the tolerance) is missing."""
    if got is None or want is None or band is None:
        return None
    ratio = got / want
    low, high = band
    worse, better = (ratio < low, ratio > high) if lower_bad else (ratio > high, ratio < low)
    verdict = REGRESSED if worse else IMPROVED if better else OK
    return {"verdict": verdict, "golden": want, "ratio": round(ratio, 3), "allowed": [round(low, 3), round(high, 3)]}


def _json(value: Any) -> Any:
    """As the golden file holds it (a tuple is a JSON list)."""
    return json.loads(json.dumps(value))


def annotate(section: str, record: dict[str, Any], golden: Golden) -> dict[str, Any]:
    """``record`` with each run row's verdict under ``golden`` (a new record; the runs themselves are not changed)."""
    if section not in RUN_SECTIONS or golden.data is None or "runs" not in record:
        return record
    verdicts = compare_rows(record["runs"], golden.rows)
    return {**record, "runs": [{**run, "golden": verdicts[run["name"]]} for run in record["runs"]]}


# ----------------------------------------------------------------------------------------------- the summary


def summarize(sections: dict[str, dict[str, Any]], golden: Golden, *, finished: bool) -> dict[str, Any]:
    """The report's ``golden`` section: every verdict but 'ok' by row, and the one-line summary.

    'missing' (a golden row this run had no row of) is only known once the check has finished."""
    where = {"kind": golden.kind, "file": display_path(golden.path)}
    if golden.error is not None:
        return {"status": "error", **where, "error": golden.error, "summary": f"golden file unusable: {golden.error}"}
    if golden.data is None:
        line = f"no golden file {where['file']}: record one with `{record_command(golden)}`"
        return {"status": "skipped", **where, "reason": line, "summary": line}
    verdicts = {run["name"]: run["golden"] for run in _run_rows(sections) if "golden" in run}
    by_verdict: dict[str, list[dict[str, Any]]] = {}
    for name, v in verdicts.items():
        by_verdict.setdefault(v["verdict"], []).append({"name": name, "detail": verdict_detail(v)})
    if finished:
        by_verdict[MISSING] = [{"name": n, "detail": ""} for n in golden.rows if n not in verdicts]
    status = "regressed" if by_verdict.get(REGRESSED) else "ok" if finished else "running"
    compared = sum(1 for v in verdicts.values() if v["verdict"] in (OK, REGRESSED, IMPROVED))
    record = {"status": status, **where, "compared": compared}
    record.update({_key(v): by_verdict.get(v, []) for v in (REGRESSED, IMPROVED, NEW, CHANGED, NOT_MEASURED, MISSING)})
    return {**record, "summary": summary_line(record)}


def _run_rows(sections: dict[str, dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for name in RUN_SECTIONS:
        yield from sections.get(name, {}).get("runs", [])


def _key(verdict: str) -> str:
    return verdict.lower().replace(" ", "_")


def summary_line(record: dict[str, Any]) -> str:
    """'golden FILE (kind): N REGRESSED: a (why); b (why); improved: ...' or '... all N compared rows within tolerance'."""
    head = f"golden {record['file']} ({record['kind']})"
    regressed = record["regressed"]
    if regressed:
        head += f": {len(regressed)} of {record['compared']} compared rows REGRESSED: " + _names(regressed)
    else:
        head += f": all {record['compared']} compared rows within tolerance"
    parts = [head]
    labels = (
        (IMPROVED, "improved"),
        (NEW, "no golden value yet (not compared; --record-golden records them)"),
        (CHANGED, "config changed since the golden (not compared)"),
    )
    labels += ((NOT_MEASURED, "not measured"), (MISSING, "missing (in the golden file, not in this run)"))
    parts += [f"{label}: {_names(record[_key(v)])}" for v, label in labels if record[_key(v)]]
    return "; ".join(parts)


def _names(items: list[dict[str, Any]]) -> str:
    return ", ".join(f"'{i['name']}'" + (f" ({i['detail']})" if i["detail"] else "") for i in items)


def verdict_detail(v: dict[str, Any]) -> str:
    """One verdict in words, e.g. 'tokens/s x0.8 < x0.95, peak memory x1': ratios to the golden, and the bound each
    crossed where it did."""
    if v["verdict"] == NEW:
        return "not in the golden file"
    if v["verdict"] == NOT_MEASURED:
        return v["reason"]
    if v["verdict"] == CHANGED:
        return ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in v["changed"].items())
    parts = []
    for key, label in (("tokens_per_s", "tokens/s"), ("peak_memory_gib", "peak memory")):
        if key in v:
            c = v[key]
            low, high = c["allowed"]
            # the bound it crossed: a ratio under the band's low end or over its high end
            bound = "" if c["verdict"] == OK else f" < {_times(low)}" if c["ratio"] < low else f" > {_times(high)}"
            parts.append(f"{label} {_times(c['ratio'])}{bound}")
    return ", ".join(parts) or "nothing to compare"


def _times(ratio: float) -> str:
    """'x0.975', 'x1.053', 'x50': three decimals at most (a ratio near 1 keeps its last digit)."""
    return "x" + f"{ratio:.3f}".rstrip("0").rstrip(".")


# ----------------------------------------------------------------------------------------------- recording


def record_golden(
    sections: dict[str, dict[str, Any]], golden: Golden, *, meta: dict[str, Any], spec_keys: Sequence[str]
) -> dict[str, Any]:
    """The golden file after this run: its ok rows re-recorded (each keeping its tolerance and why), the rows it
    did not measure kept as they were. A re-recorded row drops its old ``note``: the figure it spoke of is gone."""
    default = default_tolerance(golden.kind)
    rows: dict[str, dict[str, Any]] = {}
    for run in _run_rows(sections):
        if run["status"] != "ok" or run["name"] in rows:
            continue
        old = golden.rows.get(run["name"], {})
        rows[run["name"]] = {
            "tokens_per_s": run["tokens_per_s"],
            "peak_memory_gib": run["peak_memory_gib"],
            "mfu_pct": run.get("mfu_pct"),
            "tps_rtol": old.get("tps_rtol", default.tps_rtol),
            "memory_rtol": old.get("memory_rtol", default.memory_rtol),
            "why": old.get("why", default.why),
            "recorded": meta.get("date"),
            "spec": {k: _json(run.get(k)) for k in spec_keys},
        }
    kept = {name: row for name, row in golden.rows.items() if name not in rows}
    return {"kind": golden.kind, **meta, "rows": {**rows, **kept}}


def write_golden(data: dict[str, Any], path: Path) -> None:
    """Write ``data`` to ``path`` if the next check can read it back (``check_golden``), else raise ValueError."""
    check_golden(data, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
