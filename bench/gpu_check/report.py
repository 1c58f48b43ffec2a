"""bench/gpu_check's results: the JSON record and its markdown table, rewritten after every section."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

# The JSON's top-level sections (issue 44), in this order; the check runs them in order of value.
SECTIONS = ("environment", "sanity", "throughput", "float8", "attention", "estimator", "families", "features")
JSON_FILE, MARKDOWN_FILE = "gpu_check.json", "gpu_check.md"


class Report:
    """Every section's record; ``set`` rewrites both files at once, so a killed check leaves what it had."""

    def __init__(self, out: Path):
        self.out = out
        self.sections: dict[str, dict[str, Any]] = {name: {"status": "pending"} for name in SECTIONS}
        self.lock = threading.Lock()  # the watchdog thread writes too

    def set(self, name: str, record: dict[str, Any]) -> None:
        with self.lock:
            self.sections[name] = record
            self._write()

    def finish(self, reason: str) -> None:
        """Sections never started are skipped for ``reason``."""
        with self.lock:
            for name, record in self.sections.items():
                if record["status"] == "pending":
                    self.sections[name] = {"status": "skipped", "reason": reason}
            self._write()

    def to_json(self) -> str:
        return json.dumps(self.sections, indent=1, default=str)

    def _write(self) -> None:
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
        "| section | item | status | tokens/s | MFU % | peak GiB | detail |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for name in SECTIONS:
        lines += [_row(name, *cells) for cells in _rows(name, sections[name])]
    return "\n".join(lines) + "\n"


def _row(
    section: str, item: str, status: str, tps: Any = None, mfu: Any = None, mem: Any = None, detail: str = ""
) -> str:
    cells = [section, item, status, _num(tps, "{:,.0f}"), _num(mfu, "{:.1f}"), _num(mem, "{:.2f}"), detail]
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
    if name == "float8":
        rows += [_comparison_row(c) for c in record.get("vs_bf16", []) if c]
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
    if r.get("reused"):
        detail += " (same run as above)"
    return (r["name"], "ok", r["tokens_per_s"], r["mfu_pct"], r["peak_memory_gib"], detail)


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
