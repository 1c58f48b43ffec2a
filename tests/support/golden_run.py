"""The golden-loss run: the debug model's first 100 steps on one process, its step-100 checkpoint saved.

tests/runs/training/test_golden_loss.py checks its losses against tests/assets; tests/runs/launch/test_generate_trained.py
generates from its checkpoint. The session fixture ``golden_run`` (tests/conftest.py) runs it once.
"""

from __future__ import annotations

import os
import subprocess

from tests.support.runs import ROOT, read_metrics

CONFIG_FILE = "./train_configs/debug_model.toml"
# Everything that sets the numbers is pinned here, not left to the TOML's tunables (the flavor,
# tokenizer, corpus, optimizer and max_norm do come from the TOML: they are what "the debug model"
# means). 4 x 64 tokens per step: 100 steps take ~35 s on 2 idle cores (8 x 64: ~43 s).
ARGS = [
    "--training.steps",
    "100",
    "--training.batch_size",
    "4",
    "--training.seq_len",
    "64",
    "--optimizer.lr",
    "8e-4",
    "--training.warmup_steps",
    "5",
    "--training.seed",
    "42",
    "--training.deterministic",
    "--training.mixed_precision_param",
    "float32",
    "--activation_checkpoint.mode",
    "none",
    "--metrics.log_freq",
    "1",
]
# Saved for tests/runs/launch/test_generate_trained.py; a checkpoint changes no loss, so ARGS (what the golden file pins) leaves it out.
SAVE = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "100"]


def command() -> str:
    return f"NGPU=1 CONFIG_FILE={CONFIG_FILE} ./run_llama_train.sh {' '.join(ARGS)} --job.dump_folder DIR"


def train_losses(dump_folder: str) -> list[float]:
    """The 100 per-step losses of one single-process run through run_llama_train.sh (its step-100 checkpoint saved)."""
    env = dict(os.environ, NGPU="1", LOG_RANK="0", CONFIG_FILE=CONFIG_FILE, PREFLIGHT="0")
    cmd = ["bash", "./run_llama_train.sh", *ARGS, *SAVE, "--job.dump_folder", dump_folder]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [r for r in read_metrics(dump_folder) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 101))
    return [r["loss"] for r in records]
