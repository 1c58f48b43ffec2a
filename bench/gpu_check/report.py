"""bench/gpu_check's results: the JSON record and its markdown table, rewritten after every section."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from bench.gpu_check.breakdown import describe
from bench.gpu_check.golden import RUN_SECTIONS, Golden, annotate, summarize, verdict_detail

# The JSON's top-level sections (issue 44), in this order; the check runs them in order of value. The last,
# ``golden``, is not run: it is the run rows' comparison with the device kind's golden file (golden.py).
SECTIONS = ("environment", "sanity", *RUN_SECTIONS[:3], "estimator", *RUN_SECTIONS[3:], "golden")
JSON_FILE, MARKDOWN_FILE = "gpu_check.json", "gpu_check.md"


class Report:
    """Every section's record; ``set`` rewrites both files at once, so a killed check leaves what it had.

    Each run row is compared with ``golden`` as its section is set, so a partial report has its verdicts too."""

    def __init__(self, out: Path, golden: Golden):
        self.out, self.golden = out, golden
        self.sections: dict[str, dict[str, Any]] = {name: {"status": "pending"} for name in SECTIONS}
        self.finished = False  # a golden row with no run row is 'missing' only once every section has run
        self.lock = threading.Lock()  # the watchdog thread writes too

    def set(self, name: str, record: dict[str, Any]) -> None:
        with self.lock:
            self.sections[name] = annotate(name, record, self.golden)
            self._write()

    def finish(self, reason: str) -> None:
        """Sections never started are skipped for ``reason``."""
        with self.lock:
            for name, record in self.sections.items():
                if record["status"] == "pending" and name != "golden":
                    self.sections[name] = {"status": "skipped", "reason": reason}
            self.finished = True
            self._write()

    def regressed(self) -> list[str]:
        """The names of the rows that regressed against the golden file."""
        return [item["name"] for item in self.sections["golden"].get("regressed", [])]

    def to_json(self) -> str:
        return json.dumps(self.sections, indent=1, default=str)

    def _write(self) -> None:
        self.sections["golden"] = summarize(self.sections, self.golden, finished=self.finished)
        for name, text in ((JSON_FILE, self.to_json()), (MARKDOWN_FILE, format_markdown(self.sections))):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out / name)


def format_markdown(sections: dict[str, dict[str, Any]]) -> str:
    env = sections["environment"]
    device = env.get("gpu") or ("CPU dry run" if env.get("dry_run") else env.get("device", "?"))
    lines = [
        f"# bench/gpu_check: {device}, {env.get('date', '?')}, torch {env.get('torch', '?')}",
        "",
        "| section | item | status | tokens/s | MFU % | peak GiB | vs golden | detail |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for name in SECTIONS[:-1]:
        lines += [_row(name, *cells) for cells in _rows(name, sections[name])]
    return "\n".join(lines) + "\n\n" + _golden_line(sections["golden"]) + "\n"


def _golden_line(record: dict[str, Any]) -> str:
    """The comparison's summary, last: loud where a row regressed."""
    summary = record.get("summary") or record.get("reason") or record["status"]
    return f"**{summary}**" if record["status"] in ("regressed", "error") else summary


def _row(
    section: str,
    item: str,
    status: str,
    tps: Any = None,
    mfu: Any = None,
    mem: Any = None,
    detail: str = "",
    golden: str = "",
) -> str:
    cells = [section, item, status, _num(tps, "{:,.0f}"), _num(mfu, "{:.1f}"), _num(mem, "{:.2f}"), golden, detail]
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def _num(x: Any, fmt: str) -> str:
    return "" if x is None else fmt.format(x)


def _rows(name: str, record: dict[str, Any]) -> list[tuple]:
    status = record["status"]
    if name == "environment" and "device" in record:
        return [(record.get("gpu") or record["device"], status, None, None, None, _environment_detail(record))]
    if not any(key in record for key in ("run", "runs", "configs")):  # pending, running, skipped or failed whole
        return [("", status, None, None, None, record.get("reason") or record.get("error") or "")]
    if name == "sanity":
        return [(record["run"]["name"], status, None, None, None, _sanity_detail(record))]
    if name == "estimator":
        return [_estimate_row(r) for r in record["configs"]]
    rows = [_run_row(r) for r in record["runs"]]
    if name == "attention":
        for key in ("block_causal_vs_causal", "block_causal_auto_vs_sdpa"):
            if record.get(key):
                rows.append(_comparison_row(record[key]))
    if name in ("float8", "width_8b"):
        rows += [_comparison_row(c) for c in record.get("vs_bf16", []) if c]
    if name == "levers":
        rows += [_comparison_row(c) for c in record.get("vs_base", []) if c]
    if name == "linear_attention" and record.get("fla_vs_torch"):
        rows.append(_comparison_row(record["fla_vs_torch"]))
    rows += [_comparison_row(c) for c in record.get("vs", [])]  # compile, checkpoint
    return rows


def _environment_detail(env: dict[str, Any]) -> str:
    parts = [f"CUDA {env['torch_cuda']}" if env.get("torch_cuda") else "no CUDA"]
    if env.get("driver"):
        parts.append(f"driver {env['driver']}")
    parts.append(f"bf16 peak {env['bf16_peak_tflops']} TFLOP/s ({env['bf16_peak_source']})")
    parts.append(env["layout"])
    group = env["process_group"]
    parts.append(f"1-rank process group ({group['backend']}): {group['status']} {group.get('error', '')}".rstrip())
    return "; ".join(parts)


def _sanity_detail(record: dict[str, Any]) -> str:
    verdict = "pass" if record["pass"] else "FAIL"
    steps = len(record["device_losses"])
    return f"{steps} fp32 losses vs the CPU's: max abs diff {record['max_abs_diff']:.2e} (<= {record['tolerance']:g}: {verdict})"


def _run_row(r: dict[str, Any]) -> tuple:
    if r["status"] != "ok":
        return (r["name"], r["status"], None, None, None, r.get("error") or r.get("reason") or "")
    detail = f"step {r['step_s']} s" if r["step_s"] is not None else ""
    if r["first_steps_s"]:
        detail += f", first step {r['first_steps_s'][0]} s"
    if r.get("losses"):
        detail += f", loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"
    if r.get("breakdown"):
        detail += f"; step: {describe(r['breakdown'])}"
    if r.get("trainer_logged"):  # an RL step's rates, as the trainer logs them
        detail += "; logged: " + ", ".join(f"{k} {v:,.0f}" for k, v in r["trainer_logged"].items())
    if r.get("checkpoint"):
        ck = r["checkpoint"]
        blocked = ", ".join(f"step {step} {s} s" for step, s in ck["blocked_s"].items()) or "none"
        detail += f"; {ck['async_mode']} saves blocked training: {blocked}; the write's wait at the end {ck['close_wait_s']} s"
    if r.get("reused"):
        detail += " (same run as above)"
    return (r["name"], "ok", r["tokens_per_s"], r["mfu_pct"], r["peak_memory_gib"], detail, _golden_cell(r))


def _golden_cell(r: dict[str, Any]) -> str:
    """The row's verdict and its ratios to the golden, e.g. '**REGRESSED**: tokens/s x0.8 < x0.95, peak memory x1'."""
    if "golden" not in r:  # no golden file for this device kind: the line under the table says so
        return ""
    v = r["golden"]
    verdict = f"**{v['verdict']}**" if v["verdict"] == "REGRESSED" else v["verdict"]
    note = f"; golden note: {v['note']}" if v.get("note") else ""
    return f"{verdict}: {verdict_detail(v)}{note}"


def _estimate_row(r: dict[str, Any]) -> tuple:
    if r["status"] != "ok":
        return (r["name"], r["status"], None, None, None, r.get("error") or r.get("reason") or "")
    verdict = "within" if r["within_target"] else "OUTSIDE"
    detail = (
        f"estimate {r['predicted_gib']} GiB vs measured {r['measured_gib']} GiB: {r['rel_error']:+.1%} ({verdict} 5%)"
    )
    return (r["name"], "ok", None, None, r["measured_gib"], detail)


def _comparison_row(c: dict[str, Any]) -> tuple:
    a, b = c["runs"]
    detail = f"tokens/s x{c['tps_ratio']}, memory x{c['memory_ratio']}, max abs loss diff {c['loss_max_abs_diff']:.2e}"
    return (f"{a} vs {b}", "ok", None, None, None, detail)
