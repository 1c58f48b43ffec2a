"""Upstream torchtitan 2026's ``features`` suite through our launcher: CI's sample of scripts/upstream_2026_suite.py.

The script runs each enabled configuration of upstream's suite (tests/assets/torchtitan_2026, unchanged) at its
GPU count as CPU processes; the whole suite is run by hand (docs/compatibility.md has its table and time). CI runs
two entries through the command a user types (~40 s): ``gradient_accumulation`` (2 ranks) trains, its token
budget read as 2 micro-batches of 8 x 128 tokens per rank; ``float8_emulate_lora`` (8 ranks) is refused in the
launcher's one line before any rank starts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.runs import ROOT, read_metrics
from torchtitan.config.manager import tomllib

pytestmark = [pytest.mark.integration, pytest.mark.pool(2)]


def test_a_sample_of_upstreams_suite_trains_or_is_refused_in_one_line(tmp_path):
    work = str(tmp_path / "suite")
    command = [sys.executable, os.path.join(ROOT, "scripts", "upstream_2026_suite.py"), "--work", work]
    result = subprocess.run([*command, "--only", "gradient_accumulation", "float8_emulate_lora"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {
        line.split(" | ")[1].strip("`"): line.split(" | ") for line in result.stdout.splitlines()[2:] if "`" in line
    }
    trained = rows["llama3_debugmodel_gradient_accumulation"]
    assert (trained[2], trained[3], trained[5]) == ("2", "trains", "steps 1..2 |"), trained
    refused = rows["llama3_debugmodel_float8_emulate_lora_tp2_pp2"]
    assert refused[3] == "refused" and refused[5] == (
        "error: llama3_debugmodel_float8_emulate_lora_tp2_pp2() of torchtitan_recipes.tests.features: "
        "Trainer.Config.model_spec.converters[Float8LinearConverter].emulate = True: emulated float8 GEMMs are not "
        "built (float8 here needs torchao and a device that runs torch._scaled_mm) |"
    ), refused
    assert "1 refused, 1 trains" in result.stdout
    folder = os.path.join(work, "outputs", "gradient_accumulation.llama3_debugmodel_gradient_accumulation")
    with open(os.path.join(folder, "config.toml"), "rb") as f:
        training = tomllib.load(f)["training"]
    assert (training["batch_size"], training["seq_len"], training["gradient_accumulation_steps"]) == (8, 128, 2)
    losses = [r["loss"] for r in read_metrics(folder) if "loss" in r]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)  # ln(2048) = 7.6 at the start
