"""A poisoned CPU peak cache, through the command a user types: the run measures the peak again (one log
line), shows a real MFU and rewrites the entry. (Before, a cache holding 1.48 GFLOP/s for a shape whose
neighbours held 180-200 made every run of that shape warn `MFU would be 1882%` and show `n/a`.)

One launch of the smallest run (1 rank, 1 thread, the tiny flavor, 2 steps of 32 tokens); the rule itself
is tested in tests/unit/test_peak_cache.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.runs import ROOT
from torchtitan.build import build_model_args
from torchtitan.config.manager import JobConfig
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.observability import flops
from torchtitan.observability.flops import LinearShape
from torchtitan.observability.step_metrics import build_linear_shapes
from torchtitan.spec import get_model_spec

pytestmark = pytest.mark.integration

CONFIG = "./train_configs/debug_model.toml"
ARGS = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.steps",
    "2",
    "--training.seq_len",
    "32",
    "--training.batch_size",
    "1",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
]
POISON = 1.48e7  # 1.48 GFLOP/s / 100: on this tiny model, an MFU in the tens of thousands of %
NEIGHBOUR = 1e9  # no CPU GEMM at one thread is slower: a fresh measurement always passes its 1/4


def _run_key(monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[str]]:
    """The key the run's rank looks up (at 1 thread), and two neighbours': the same but smaller GEMMs."""
    monkeypatch.chdir(ROOT)  # the config's tokenizer path is relative to the repository, as the run's
    config = JobConfig.parse_args(["--job.config_file", CONFIG, *ARGS])
    spec = get_model_spec(config.model.name)
    args = build_model_args(config, spec, build_tokenizer(config.model.tokenizer_path).n_words, device_type="cpu")
    linears = build_linear_shapes(args, config.training.batch_size * config.training.seq_len)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        smaller = [flops._cpu_cache_key(torch.float32, (LinearShape(8, 8, width),)) for width in (8, 16)]
        return flops._cpu_cache_key(torch.float32, linears), smaller
    finally:
        torch.set_num_threads(threads)


def test_a_poisoned_peak_is_measured_again_and_mfu_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key, neighbours = _run_key(monkeypatch)
    cache = tmp_path / "cache" / "torchtitan" / "peak_flops.json"
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({key: POISON, **dict.fromkeys(neighbours, NEIGHBOUR)}))
    env = dict(
        os.environ,
        NGPU="1",
        OMP_NUM_THREADS="1",
        PREFLIGHT="0",
        CONFIG_FILE=CONFIG,
        XDG_CACHE_HOME=str(tmp_path / "cache"),
    )
    dump = tmp_path / "dump"
    cmd = ["bash", "./run_llama_train.sh", *ARGS, "--job.dump_folder", str(dump)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]

    lines = [line for line in out.splitlines() if "CPU peak" in line]
    assert len(lines) == 1, lines
    assert f"not using the CPU peak cached in {cache}: 0.0148 GFLOP/s is under 1/4 of the 1 GFLOP/s" in lines[0]
    assert "re-measured CPU peak" in lines[0] and lines[0].endswith(f"; cached in {cache}"), lines[0]
    assert "MFU would be" not in out
    step_lines = [line for line in out.splitlines() if re.search(r"\bstep \d/2 ", line)]
    assert len(step_lines) == 2 and all(re.search(r" mfu +\d+\.\d\d% ", line) for line in step_lines), step_lines
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(0 < r["mfu"] <= 100 for r in records), [r["mfu"] for r in records]

    entries = json.loads(cache.read_text())
    assert entries[key] >= NEIGHBOUR / 4 and entries == {key: entries[key], **dict.fromkeys(neighbours, NEIGHBOUR)}
