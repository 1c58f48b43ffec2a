"""Launching trainer runs at the matrix's settings (pool jobs or run_llama_train.sh) and reading what they wrote.

COMMON is what every parity run shares (the parity flavor, STEPS steps of seq 64, fp32, deterministic, lr 1e-2);
``train`` runs a job in the worker pool of its world size (tests/support/pool.py), ``run_train`` through
run_llama_train.sh where what the launcher prints or how it exits matters.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass

import pytest

from tests.support.pool import run_train_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 6
VAL_FREQ = 3
GLOBAL_BATCH = 8
VALIDATION = ["--validation.enabled", "--validation.freq", str(VAL_FREQ), "--validation.steps", "2"]
# The parity flavor of every family (dim 64, 4 layers; MoE: 4 experts, top 2): layouts are compared
# on it. The debug flavor (dim 256, 8 layers) stays for the golden loss, memory options and RSS rows.
PARITY_FLAVOR = "debugmodel_tiny"
COMMON = [
    "--model.flavor",
    PARITY_FLAVOR,
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "64",
    "--training.warmup_steps",
    "2",
    # a higher peak lr than the debug config's, so the tiny flavor's loss visibly falls within the
    # few steps (measured, one process: 8.27 -> 7.54 at 1e-2; at 3e-3 only 8.27 -> 8.10)
    "--optimizer.lr",
    "1e-2",
    "--training.mixed_precision_param",
    "float32",
    "--training.seed",
    "42",
    "--training.deterministic",
    "--metrics.log_freq",
    "1",
    "--activation_checkpoint.mode",
    "none",
]


def trainer_argv(overrides: list[str], dump_folder: str) -> list[str]:
    """The trainer's arguments for a run with ``overrides``: what run_llama_train.sh would pass."""
    return [
        "--job.config_file",
        "./train_configs/debug_model.toml",
        *COMMON,
        *overrides,
        "--job.dump_folder",
        dump_folder,
    ]


@dataclass(frozen=True)
class Launch:
    """What a series of pooled trainer jobs gave: 0 when every job ran as expected."""

    returncode: int
    stdout: str = ""
    stderr: str = ""


def launch_jobs(ngpu: int, jobs: list[list[str] | dict], spec_path: str) -> Launch:
    """Trainer jobs (argument lists with their --job.dump_folder, or ``{"argv", "expect_error"}`` dicts), in order,
    in the pool of ``ngpu`` workers; stops at the first that fails (the later ones get no status file).

    ``spec_path`` keeps the list of jobs beside their folders, for reading a failure afterwards."""
    specs = [job if isinstance(job, dict) else {"argv": job} for job in jobs]
    with open(spec_path, "w") as f:
        json.dump(specs, f)
    for spec in specs:
        status = run_train_job(ngpu, spec["argv"], expect_error=spec.get("expect_error"))
        if not status["ok"]:
            return Launch(1, stderr=status["error"] or "")
    return Launch(0)


def check_job(name: str, folder: str, launch: Launch | None = None) -> str:
    """Fail unless the job whose dump folder is ``folder`` ran and succeeded; returns its rank-0 log."""
    status_path = os.path.join(folder, "job_status.json")
    if not os.path.isfile(status_path):
        why = (
            "" if launch is None else f": its launch exited with {launch.returncode} before it\n{launch.stderr[-3000:]}"
        )
        pytest.fail(f"{name} was not run{why}")
    with open(status_path) as f:
        status = json.load(f)
    assert status["ok"], f"{name} failed:\n{status['error']}\n{_log_tails(folder)}"
    with open(os.path.join(folder, "rank0.log")) as f:
        return f.read()


def _log_tails(folder: str) -> str:
    tails = []
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".log")):
        with open(os.path.join(folder, name)) as f:
            tails.append(f"--- {name}\n" + "".join(f.readlines()[-15:]))
    return "\n".join(tails)


def run_train(ngpu: int, dump_folder: str, overrides: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    # PREFLIGHT=0: every rank validates the config anyway; tests/runs/launch/test_bad_input.py covers the preflight.
    env = dict(os.environ, NGPU=str(ngpu), LOG_RANK="0", CONFIG_FILE="./train_configs/debug_model.toml", PREFLIGHT="0")
    cmd = ["bash", "./run_llama_train.sh", *COMMON, *overrides, "--job.dump_folder", dump_folder]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def train(ngpu: int, dump_folder: str, overrides: list[str]) -> Launch:
    """``run_train``'s run (the same arguments) as a job in the worker pool; its stderr is rank 0's log.

    For checks of what a run computes; what the launcher prints or how it exits needs ``run_train``."""
    status = run_train_job(ngpu, trainer_argv(overrides, dump_folder))
    log_path = os.path.join(dump_folder, "rank0.log")
    log = ""
    if os.path.isfile(log_path):
        with open(log_path) as f:
            log = f.read()
    return Launch(0 if status["ok"] else 1, stderr=log + ("" if status["ok"] else status["error"]))


def read_metrics(dump_folder: str) -> list[dict]:
    with open(os.path.join(dump_folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def step_losses(folder: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(folder) if "loss" in r}


def complete_steps(folder: str) -> list[int]:
    root = os.path.join(folder, "checkpoint")
    return sorted(int(d[5:]) for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, ".complete")))


def tensor_metadata(step_path: str) -> dict[str, object]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(step_path).read_metadata().state_dict_metadata
    return {k: (v.properties.dtype, tuple(v.size)) for k, v in meta.items() if isinstance(v, TensorStorageMetadata)}


def tokenizer_n_words() -> int:
    from torchtitan.config.manager import JobConfig
    from torchtitan.datasets.tokenizer import build_tokenizer

    return build_tokenizer(JobConfig.parse_args(trainer_argv([], "/tmp/unused")).model.tokenizer_path).n_words


# "error: ..." (the pre-launch check, the script) or "error (rank 1): ..." / "error (ranks 0,1): ..." (the launcher)
ERROR_LINE = re.compile(r"^error( \(ranks? [\d,]+\))?: ")


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if ERROR_LINE.match(line) or "error:" in line]
