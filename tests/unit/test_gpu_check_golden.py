"""bench/gpu_check's golden comparison (bench/gpu_check/golden.py) on rows made up here from the stored H100 golden
file: no training, no torch. The dry run's own comparison against bench/golden/cpu_dry_run.json is checked in
tests/runs/launch/test_gpu_check.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.gpu_check import golden as goldens
from bench.gpu_check.__main__ import EXIT_REGRESSED, _exit_code
from bench.gpu_check.report import JSON_FILE, MARKDOWN_FILE, Report

H100 = goldens.load_golden("h100")
SLOW, HUNGRY, WITHIN, GONE = (
    "1B eager seq 2048",
    "1B compile seq 2048",
    "1B eager seq 8192",
    "3B eager seq 2048 full AC",
)


def run_row(name: str, *, tps_scale: float = 1.0, memory_scale: float = 1.0) -> dict[str, Any]:
    """A run record as runs.py writes one, at the golden row's figures scaled."""
    row = H100.rows[name]
    return {
        "name": name,
        "status": "ok",
        **row["spec"],
        "tokens_per_s": row["tokens_per_s"] * tps_scale,
        "mfu_pct": row["mfu_pct"],
        "peak_memory_gib": row["peak_memory_gib"] * memory_scale,
        "step_s": 0.2,
        "first_steps_s": [1.0, 0.2],
        "losses": [12.25, 12.0],
    }


def beyond(rtol: float) -> float:
    """A scale just past a tolerance's edge on the bad side (tokens/s: below; memory: see callers)."""
    return (1 - rtol) * 0.98


def test_every_stored_golden_file_reads():
    files = sorted(goldens.GOLDEN_DIR.glob("*.json"))
    assert {f.stem for f in files} >= {"h100", "cpu_dry_run"}, files
    for path in files:
        data = json.loads(path.read_text())
        goldens.check_golden(data, path)
        assert data["kind"] == path.stem and data["rows"], path
        for key in ("device", "torch", "date", "command"):
            assert data.get(key), (path, key)


def test_slowed_and_hungrier_rows_regress_a_row_within_tolerance_does_not(tmp_path):
    slow, hungry, within = (H100.rows[n] for n in (SLOW, HUNGRY, WITHIN))
    runs = [
        run_row(SLOW, tps_scale=beyond(slow["tps_rtol"])),
        run_row(HUNGRY, memory_scale=(1 + hungry["memory_rtol"]) * 1.02),
        # half of each tolerance, on the bad side of both measures
        run_row(WITHIN, tps_scale=1 - within["tps_rtol"] / 2, memory_scale=1 + within["memory_rtol"] / 2),
    ]
    verdicts = goldens.compare_rows(runs, H100.rows)
    assert verdicts[SLOW]["verdict"] == goldens.REGRESSED, verdicts[SLOW]
    assert verdicts[SLOW]["tokens_per_s"]["verdict"] == goldens.REGRESSED
    assert verdicts[SLOW]["peak_memory_gib"]["verdict"] == goldens.OK
    assert verdicts[HUNGRY]["verdict"] == goldens.REGRESSED, verdicts[HUNGRY]
    assert verdicts[HUNGRY]["peak_memory_gib"]["verdict"] == goldens.REGRESSED
    assert verdicts[WITHIN]["verdict"] == goldens.OK, verdicts[WITHIN]

    report = Report(tmp_path, H100)
    report.set("throughput", {"status": "ok", "runs": runs})
    report.finish("time budget")
    record = json.loads((tmp_path / JSON_FILE).read_text())
    assert [r["golden"]["verdict"] for r in record["throughput"]["runs"]] == ["REGRESSED", "REGRESSED", "ok"]
    assert record["golden"]["status"] == "regressed"
    assert [r["name"] for r in record["golden"]["regressed"]] == [SLOW, HUNGRY]
    markdown = (tmp_path / MARKDOWN_FILE).read_text()
    last = markdown.rstrip("\n").splitlines()[-1]
    assert last.startswith("**golden bench/golden/h100.json (h100): 2 of 3 compared rows REGRESSED: "), last
    slow_low = f"< x{1 - slow['tps_rtol']:.3g}"  # '< x0.95': the bound the row crossed
    memory_high = f"> x{1 + hungry['memory_rtol']:.3g}"
    assert f"'{SLOW}' (tokens/s x" in last and slow_low in last, last
    assert f"'{HUNGRY}' (tokens/s x1, peak memory x" in last and memory_high in last, last
    assert WITHIN not in last.split("missing")[0]  # only in the list of golden rows this made-up run lacks
    lines = {line.split(" | ")[1]: line for line in markdown.splitlines() if line.startswith("| throughput |")}
    assert "| **REGRESSED**: tokens/s x" in lines[SLOW]
    within_cell = f"| ok: tokens/s x{1 - within['tps_rtol'] / 2:.3f}, peak memory x{1 + within['memory_rtol'] / 2:.3f}"
    assert within_cell in lines[WITHIN], lines[WITHIN]
    # the exit code ignores a regression unless asked
    assert _exit_code(report, fail_on_regression=False) == 0
    assert _exit_code(report, fail_on_regression=True) == EXIT_REGRESSED


def test_improved_changed_new_and_missing_rows():
    rows = {n: H100.rows[n] for n in (SLOW, HUNGRY, WITHIN, GONE)}
    golden = goldens.Golden("h100", H100.path, {"rows": rows})
    faster = run_row(SLOW, tps_scale=1.2)
    other_shape = {**run_row(HUNGRY), "seq_len": 4096}
    sections = {
        "throughput": {"status": "ok", "runs": [faster, other_shape, {**run_row(WITHIN), "name": "1B new row"}]},
        "float8": {"status": "ok", "runs": [{"name": WITHIN, "status": "skipped", "reason": "time budget"}]},
    }
    annotated = {name: goldens.annotate(name, record, golden) for name, record in sections.items()}
    verdicts = [r["golden"] for record in annotated.values() for r in record["runs"]]
    assert [v["verdict"] for v in verdicts] == [goldens.IMPROVED, goldens.CHANGED, goldens.NEW, goldens.NOT_MEASURED]
    assert verdicts[1]["changed"] == {"seq_len": [2048, 4096]}
    running = goldens.summarize(annotated, golden, finished=False)
    assert running["status"] == "running" and running["missing"] == []  # later sections may still run them
    done = goldens.summarize(annotated, golden, finished=True)
    assert done["status"] == "ok" and done["compared"] == 1
    assert [m["name"] for m in done["missing"]] == [GONE]  # WITHIN's row exists (skipped): not measured
    assert "all 1 compared rows within tolerance; improved: " in done["summary"]
    assert (
        "config changed since the golden (not compared): '1B compile seq 2048' (seq_len 2048 -> 4096)"
        in (done["summary"])
    )


def test_no_golden_file_is_one_line_and_no_failure(tmp_path):
    golden = goldens.load_golden("h200", tmp_path)
    assert golden.data is None and golden.error is None
    report = Report(tmp_path, golden)
    report.set("throughput", {"status": "ok", "runs": [run_row(SLOW, tps_scale=0.5)]})
    report.finish("time budget")
    record = json.loads((tmp_path / JSON_FILE).read_text())
    assert "golden" not in record["throughput"]["runs"][0]
    assert record["golden"]["status"] == "skipped"
    line = f"no golden file {tmp_path}/h200.json: record one with "
    line += f"`python -m bench.gpu_check --out OUT --record-golden --golden-dir {tmp_path}`"
    assert record["golden"]["summary"] == line
    assert (tmp_path / MARKDOWN_FILE).read_text().endswith("\n\n" + line + "\n")
    assert _exit_code(report, fail_on_regression=True) == 0


def test_unreadable_golden_file_is_an_error_naming_it(tmp_path):
    row = {**H100.rows[SLOW], "tps_rtol": 1.5}
    (tmp_path / "h100.json").write_text(json.dumps({"rows": {SLOW: row}}))
    golden = goldens.load_golden("h100", tmp_path)
    assert golden.data is None
    assert f"h100.json row '{SLOW}': tps_rtol = 1.5; allowed: a number in [0, 1)" in golden.error
    assert goldens.summarize({}, golden, finished=True)["status"] == "error"


@pytest.mark.parametrize(
    "name, kind",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100_pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA A100-SXM4-80GB", "nvidia_a100_sxm4_80gb"),
    ],
)
def test_device_kind_from_the_gpu_name(name, kind):
    assert goldens.device_kind(name, dry_run=False, device_type="cuda") == kind
    assert goldens.device_kind(name, dry_run=True, device_type="cpu") == goldens.DRY_RUN_KIND


def test_recording_keeps_tolerances_and_unmeasured_rows(tmp_path):
    old = goldens.Golden("h100", tmp_path / "h100.json", {"rows": {n: H100.rows[n] for n in (SLOW, GONE)}})
    assert "note" in old.rows[GONE]
    sections = {"throughput": {"runs": [run_row(SLOW, tps_scale=0.5), {**run_row(WITHIN), "name": "a new row"}]}}
    meta = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "date": "2026-12-01", "command": "python -m"}
    spec_keys = list(H100.rows[SLOW]["spec"])
    data = goldens.record_golden(sections, old, meta=meta, spec_keys=spec_keys)
    goldens.check_golden(data, old.path)
    assert list(data["rows"]) == [SLOW, "a new row", GONE]
    assert data["rows"][SLOW]["tokens_per_s"] == H100.rows[SLOW]["tokens_per_s"] * 0.5
    assert data["rows"][SLOW]["why"] == H100.rows[SLOW]["why"] and data["rows"][GONE] == H100.rows[GONE]
    assert data["rows"]["a new row"]["tps_rtol"] == goldens.GPU_TOLERANCE.tps_rtol
    goldens.write_golden(data, old.path)
    again = goldens.load_golden("h100", tmp_path)
    assert all(
        v["verdict"] == goldens.OK for v in goldens.compare_rows(sections["throughput"]["runs"], again.rows).values()
    )


def test_display_path_is_relative_to_the_repository():
    assert goldens.display_path(goldens.GOLDEN_DIR / "h100.json") == "bench/golden/h100.json"
    assert goldens.display_path(Path("/elsewhere/x.json")) == "/elsewhere/x.json"
