"""The loss-parity matrix: torchrun runs of the debug model through run_llama_train.sh.

Each row trains the same global batch (8 samples x 64 tokens per optimizer step) for STEPS steps
under a different parallel layout, and its per-step global losses must equal those of the
single-process run. (Validation-loss parity across layouts: tests/test_run_experience.py.) That holds because weights are a function of the seed (not of the layout)
and global batch k holds the same samples whatever the data-parallel degree.

Tolerance: relative 1e-5 per step in fp32 (RTOL). Layouts differ only in the order of the
floating-point reductions (FSDP's reduce-scatter vs. one process's sum), ~1e-7 relative per step.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field

import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
VAL_FREQ = 3
GLOBAL_BATCH = 8
RTOL = 1e-5
VALIDATION = ["--validation.enabled", "--validation.freq", str(VAL_FREQ), "--validation.steps", "2"]
COMMON = [
    "--training.steps", str(STEPS),
    "--training.seq_len", "64",
    "--training.warmup_steps", "2",
    # a higher peak lr than the debug config's, so the loss visibly falls within the few steps
    "--optimizer.lr", "3e-3",
    "--training.mixed_precision_param", "float32",
    "--training.seed", "42",
    "--training.deterministic",
    "--metrics.log_freq", "1",
    "--activation_checkpoint.mode", "none",
]


@dataclass(frozen=True)
class Row:
    name: str
    ngpu: int
    local_batch: int
    overrides: list[str] = field(default_factory=list)
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def args(self) -> list[str]:
        return [
            *self.overrides,
            "--training.tensor_parallel_degree", str(self.tp),
            "--experimental.pipeline_parallel_degree", str(self.pp),
            "--experimental.context_parallel_degree", str(self.cp),
        ]


def pp_schedule(name: str, microbatches: int = 4) -> list[str]:
    return [
        "--experimental.pipeline_parallel_schedule", name,
        "--experimental.pipeline_parallel_microbatches", str(microbatches),
    ]


PP_CSV = [
    *pp_schedule("loop"),
    "--experimental.pipeline_parallel_schedule_csv", "./tests/assets/pp2_breadth_first_4stages_4mb.csv",
]


ASYNC = ["--experimental.enable_async_tensor_parallel"]
ROTATE_ALLGATHER = ["--experimental.context_parallel_rotate_method", "allgather"]
ROTATE_ALLTOALL = ["--experimental.context_parallel_rotate_method", "alltoall"]
HSDP_2x2 = ["--training.data_parallel_replicate_degree", "2", "--training.data_parallel_shard_degree", "2"]


ROWS = [
    Row("fsdp2", 2, 4),
    Row("fsdp4", 4, 2),
    Row("hsdp_2x2", 4, 2, HSDP_2x2),
    Row("ddp2", 2, 4, ["--training.data_parallel_replicate_degree", "2", "--training.data_parallel_shard_degree", "1"]),
    Row("fsdp2_grad_accum2", 2, 2, ["--training.gradient_accumulation_steps", "2"]),
    Row("fsdp2_ac_full", 2, 4, ["--activation_checkpoint.mode", "full"]),
    Row("fsdp2_ac_every_2nd", 2, 4, ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"]),
    Row("fsdp2_ac_op", 2, 4, ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]),
    Row("fsdp2_compile", 2, 4, ["--training.compile"]),
    Row("fsdp2_reshard_never", 2, 4, ["--training.fsdp_reshard_after_forward", "never"]),
    Row("fsdp2_prefetch2", 2, 4, ["--training.fsdp_prefetch_depth", "2"]),
    Row("fsdp2_cpu_offload", 2, 4, ["--training.enable_cpu_offload"]),
    # tensor parallel: TP ranks share their data-parallel rank's samples
    Row("tp2", 2, 8, tp=2),
    Row("tp2_loss_parallel_off", 2, 8, ["--training.enable_loss_parallel", "false"], tp=2),
    Row("fsdp2_tp2", 4, 4, tp=2),
    Row("hsdp_2x2_tp2", 8, 2, HSDP_2x2, tp=2),
    Row("async_tp2", 2, 8, ASYNC, tp=2),
    Row("fsdp2_async_tp2", 4, 4, ASYNC, tp=2),
    # pipeline parallel: the debug model's 8 layers in 2 stages (4 stages for the multi-stage ones)
    Row("pp2_gpipe", 2, 8, pp_schedule("GPipe"), pp=2),
    Row("pp2_1f1b", 2, 8, pp_schedule("1F1B"), pp=2),
    Row("pp2_interleaved1f1b", 2, 8, pp_schedule("Interleaved1F1B"), pp=2),
    Row("pp2_loopedbfs", 2, 8, pp_schedule("LoopedBFS"), pp=2),
    Row("pp2_interleaved_zero_bubble", 2, 8, pp_schedule("InterleavedZeroBubble"), pp=2),
    Row("pp2_zbv_zero_bubble", 2, 8, pp_schedule("ZBVZeroBubble"), pp=2),
    Row("pp2_dualpipev", 2, 8, pp_schedule("DualPipeV"), pp=2),
    Row("pp2_csv_schedule", 2, 8, PP_CSV, pp=2),
    Row("pp2_fsdp2", 4, 4, pp_schedule("1F1B", 2), pp=2),
    Row("pp2_tp2", 4, 8, pp_schedule("1F1B"), tp=2, pp=2),
    Row("pp2_fsdp2_tp2", 8, 4, pp_schedule("1F1B", 2), tp=2, pp=2),
    # context parallel: CP ranks split each of their data-parallel rank's sequences
    Row("cp2_allgather", 2, 8, ROTATE_ALLGATHER, cp=2),
    Row("cp2_alltoall", 2, 8, ROTATE_ALLTOALL, cp=2),
    Row("cp4", 4, 8, ROTATE_ALLTOALL, cp=4),
    Row("fsdp2_cp2", 4, 4, ROTATE_ALLGATHER, cp=2),
    Row("tp2_cp2", 4, 8, ROTATE_ALLTOALL, tp=2, cp=2),
    Row("fsdp2_tp2_cp2", 8, 4, ROTATE_ALLTOALL, tp=2, cp=2),
    Row("fsdp2_tp2_cp2_pp2", 16, 4, [*ROTATE_ALLTOALL, *pp_schedule("1F1B", 2)], tp=2, cp=2, pp=2),
]


def run_train(ngpu: int, dump_folder: str, overrides: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    # PREFLIGHT=0: every rank validates the config anyway; tests/test_bad_input.py covers the preflight.
    env = dict(os.environ, NGPU=str(ngpu), LOG_RANK="0", CONFIG_FILE="./train_configs/debug_model.toml", PREFLIGHT="0")
    cmd = ["bash", "./run_llama_train.sh", *COMMON, *overrides, "--job.dump_folder", dump_folder]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def read_metrics(dump_folder: str) -> list[dict]:
    with open(os.path.join(dump_folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_losses(ngpu: int, local_batch: int, dump_folder: str, overrides: list[str]) -> dict[str, list[float]]:
    """Run, then {"loss": per-step losses, "validation_loss": per-validation losses}."""
    result = run_train(ngpu, dump_folder, ["--training.batch_size", str(local_batch), *overrides])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return losses_of(dump_folder)


def losses_of(dump_folder: str) -> dict[str, list[float]]:
    records = read_metrics(dump_folder)
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "validation_loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert [r["step"] for r in val] in ([], list(range(VAL_FREQ, STEPS + 1, VAL_FREQ)))
    return {"loss": [r["loss"] for r in train], "validation_loss": [r["validation_loss"] for r in val]}


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_loss_parity(row: Row, reference: dict[str, list[float]], tmp_path):
    grad_accum = 2 if "--training.gradient_accumulation_steps" in row.overrides else 1
    dp = row.ngpu // (row.tp * row.pp * row.cp)
    assert dp * row.local_batch * grad_accum == GLOBAL_BATCH
    losses = train_losses(row.ngpu, row.local_batch, str(tmp_path), row.args())
    for key in ("loss",):
        for i, (got, want) in enumerate(zip(losses[key], reference[key], strict=True)):
            assert abs(got - want) <= RTOL * abs(want), f"{key} #{i}: {row.name} {got} vs single-process {want}"
