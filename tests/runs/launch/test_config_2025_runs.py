"""torchtitan's 2025 config schema through the trainer (worker-pool jobs, 2 ranks).

* Upstream's llama3 ``debug_model.toml`` (tests/assets/torchtitan_2025, unchanged) trains: only its dataset
  and ``hf_assets_path`` point at local things (the shipped pydocs corpus, a tokenizer folder made here),
  it computes in fp32 (bf16 is ~15x slower on an AVX2-only CPU) and its seq_len is cut from 2048 to 128
  (the same code path at 1/16 of the tokens: unchanged, the file costs ~125 s of CI on 2 cores; run that
  way by hand it passes these same checks); the lr each of its 10 steps logs is upstream's
  warmup-stable-decay.
* Upstream's DeepSeek-V3 ``debug_model.toml`` trains too: its inert ``[quantize.grouped_mm.float8]``
  section and its op-level activation checkpointing included, with only its data and tokenizer pointed
  here, and seq_len, steps and dtype cut down (below). The other debug files that train on CPU
  (gpt-oss's, qwen3's MoE one) take the same paths past their config, which tests/unit/test_config_2025.py
  checks for every file: one family's run is enough here.
* 2025-style flags give per-step losses equal to the same run in our keys: the matrix row
  ``fsdp2_grad_accum2`` (tests/runs/training/test_parity_matrix.py), so the twin is shared with the matrix.
"""

from __future__ import annotations

import os

import pytest

from tests.support.hf import write_tokenizer
from tests.support.matrix import ROWS, MatrixLaunches, losses_of
from tests.support.pool import run_train_job
from tests.support.runs import COMMON, PARITY_FLAVOR, ROOT, check_job, read_metrics
from torchtitan.config.manager import tomllib

pytestmark = [pytest.mark.integration, pytest.mark.pool(2)]

ASSETS = os.path.join(ROOT, "tests", "assets", "torchtitan_2025")
DEBUG_2025 = os.path.join(ASSETS, "llama3_debug_model.toml")
TWIN = next(r for r in ROWS if r.name == "fsdp2_grad_accum2")  # 2 ranks x local batch 2 x 2 micro-batches


@pytest.fixture(scope="module")
def hf_assets(tmp_path_factory) -> str:
    """A folder like upstream's tests/assets/tokenizer: tokenizer.json + tokenizer_config.json (bos and eos)."""
    folder = tmp_path_factory.mktemp("hf_assets")
    write_tokenizer(folder, {"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"})
    return str(folder)


def test_upstream_2025_debug_model_toml_trains(tmp_path, hf_assets):
    folder = str(tmp_path / "debug_2025")
    argv = [
        "--job.config_file",
        DEBUG_2025,
        "--training.dataset",  # upstream's c4_test is not here
        "pydocs",
        "--model.hf_assets_path",
        hf_assets,
        "--training.seq_len",
        "128",
        "--training.local_batch_size",  # the file's 8 x 128 tokens per rank: 4x the compute this check needs
        "2",
        "--training.mixed_precision_param",  # bf16 on an AVX2-only CPU is ~15x slower; this run is not about bf16
        "float32",
        "--job.dump_folder",
        folder,
    ]
    run_train_job(2, argv)
    check_job("2025 debug_model.toml", folder)
    records = [r for r in read_metrics(folder) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 11))  # log_freq = 1, as the file says
    # lr after step k = 8e-4 x upstream's factor at k: warmup 2 ((k+1)/2 for k < 2), decay round(10 x 0.8) = 8,
    # stable 10 + 1 - 2 - 8 = 1 -> 1.0 (k=1), 1.0 (k=2, stable), then linear: 1 - (k+1-3)/8 for k = 3..10
    factors = [1.0, 1.0] + [1 - (k + 1 - 3) / 8 for k in range(3, 11)]
    assert [r["lr"] for r in records] == pytest.approx([8e-4 * f for f in factors], abs=1e-12)
    assert records[-1]["loss"] < records[0]["loss"]  # it trains
    with open(os.path.join(folder, "config.toml")) as f:  # dumped in our keys
        dumped = f.read()
    assert 'lr_schedule = "wsd"' in dumped and "[parallelism]" not in dumped


def test_upstream_2025_deepseek_v3_debug_toml_trains(tmp_path, hf_assets):
    folder = str(tmp_path / "dsv3_2025")
    argv = [
        *("--job.config_file", os.path.join(ASSETS, "deepseek_v3_debug_model.toml")),
        *("--training.dataset", "pydocs", "--model.hf_assets_path", hf_assets),
        # 4 steps of 2 x 64 tokens per rank (not 10 of 8 x 2048): the same code path at 1/320 of the tokens; fp32,
        # since bf16 on an AVX2-only CPU is ~15x slower (docs/testing.md) and this run is not about bf16
        *("--training.local_batch_size", "2", "--training.seq_len", "64", "--training.steps", "4"),
        *("--training.mixed_precision_param", "float32"),
        *("--job.dump_folder", folder),
    ]
    run_train_job(2, argv)
    check_job("2025 deepseek_v3 debug_model.toml", folder)
    records = [r for r in read_metrics(folder) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # log_freq = 1, as the file says
    assert records[-1]["loss"] < records[0]["loss"]  # it trains
    with open(os.path.join(folder, "config.toml")) as f:  # dumped in our keys: op-level AC, the MoE family
        dumped = f.read()
    assert 'name = "deepseek_v3"' in dumped and 'selective_ac_option = "op"' in dumped
    assert "quantize" not in tomllib.loads(dumped)  # upstream's inert [quantize.*] sections are not carried over


def test_2025_flags_train_like_our_keys(tmp_path, matrix: MatrixLaunches):
    folder = str(tmp_path / "flags_2025")
    spelled_2025 = [
        "--job.config_file",
        "./train_configs/debug_model.toml",
        *COMMON,  # the matrix's common flags, then the same settings again in 2025's spellings (they must agree)
        "--debug.seed",
        "42",
        "--debug.deterministic",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "8",  # = 2 x dp 2 x 2 accumulation steps
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "1",
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--parallelism.context_parallel_degree",
        "1",
        "--compile.enable",
        "false",
        "--checkpoint.enable",
        "--job.dump_folder",
        folder,
    ]
    assert PARITY_FLAVOR in COMMON
    run_train_job(2, spelled_2025)
    check_job("2025 flags", folder)
    got, want = losses_of(folder), matrix.losses(TWIN)
    assert got["loss"] == want["loss"], f"2025 flags {got['loss']} vs our keys {want['loss']}"
    assert os.path.isdir(os.path.join(folder, "checkpoint"))  # checkpoint.enable saved the last step
