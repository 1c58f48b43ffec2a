"""Qwen3.5 (``model.name = "qwen3_5"``) through the trainer (worker-pool jobs): the tiny flavor (3 Gated DeltaNet
layers and one gated full attention, chunk 16) on the short-document corpus with block_causal documents (every row
runs the per-document recurrence and convolution, and the attention's document mask), 4 steps at seq 64.

A 1-rank reference, and FSDP2 + gradient accumulation 2, PP2 (1F1B, full AC) and TP2 (Gated DeltaNet sharded by
heads, selective op AC) at 2 ranks, each at loss and grad-norm parity (the matrix's rule: loss rtol 1e-5, grad norm 3e-4); context parallel,
async TP and uneven heads refused in one line. Qwen3.5-MoE (``qwen3_5_moe``, the tiny flavor: 4 experts, top 2,
the gated shared expert, expert-bias balancing) has its own 1-rank reference, and FSDP2 + EP2 and TP2 x EP2 at 2
ranks and HSDP 2x2 + EP2 at 4 at parity with it. The logits of both
equal transformers' (tests/unit/test_qwen3_5.py).
"""

from __future__ import annotations

import pytest

from tests.support.matrix import DOCS_TRAIN, GRAD_NORM_RTOL, RTOL, Row, pp_schedule
from tests.support.pool import run_train_job
from tests.support.runs import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2, 4)]

STEPS = 4
QWEN3_5 = [
    *("--job.config_file", "./train_configs/qwen3_5_debug.toml", "--model.flavor", "debugmodel_tiny"),
    *("--training.steps", str(STEPS), "--metrics.log_freq", "1", "--training.seq_len", "64"),
    *("--training.warmup_steps", "0", "--optimizer.lr", "1e-2"),
    *DOCS_TRAIN,  # the short-document corpus: several documents in every 64-token window
    "--model.positions_per_document",
]
MOE = ["--model.name", "qwen3_5_moe"]
EP2 = ["--experimental.expert_parallel_degree", "2"]
REFERENCE = Row("qwen3_5_1proc", 1, 4)
MOE_REFERENCE = Row("qwen3_5_moe_1proc", 1, 4, MOE)
ROWS = [
    Row("qwen3_5_fsdp2_accum2", 2, 1, ["--training.gradient_accumulation_steps", "2"]),
    # activation checkpointing rides on these rows (it changes no number): full AC under PP, selective op under TP
    Row("qwen3_5_pp2_1f1b", 2, 4, [*pp_schedule("1F1B"), "--activation_checkpoint.mode", "full"], pp=2),
    Row(
        "qwen3_5_tp2",
        2,
        4,
        ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
        tp=2,
    ),
    # compiled: Gated DeltaNet's chunked rule and the MoE around its routed experts (eager), against eager
    Row("qwen3_5_moe_fsdp2_ep2_compile", 2, 2, [*MOE, *EP2, "--training.compile"]),
    Row("qwen3_5_moe_tp2_ep2", 2, 4, [*MOE, *EP2], tp=2),
    Row(
        "qwen3_5_moe_hsdp_2x2_ep2",
        4,
        1,
        [*MOE, *EP2, "--training.data_parallel_shard_degree", "2", "--training.data_parallel_replicate_degree", "2"],
    ),
]
REFERENCES = [REFERENCE, MOE_REFERENCE]


def _run(row: Row, folder: str) -> dict:
    argv = [*QWEN3_5, "--training.batch_size", str(row.local_batch), *row.args(), "--job.dump_folder", folder]
    return run_train_job(row.ngpu, argv, restart_after="--training.compile" in argv)  # as the matrix's


def _records(folder: str) -> list[dict]:
    return [r for r in read_metrics(folder) if "loss" in r]


def _close(a: float, b: float, what: str, rtol: float = RTOL) -> None:
    assert abs(a - b) <= rtol * max(abs(a), abs(b)), f"{what}: {a} vs {b} (rtol {rtol})"


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, str]:
    """Each family's 1-rank run (its losses fall): the folder, by whether the rows are the MoE's."""
    folders = {}
    for row in REFERENCES:
        folder = str(tmp_path_factory.mktemp("qwen3_5") / row.name)
        status = _run(row, folder)
        assert status["ok"], status["error"]
        losses = [r["loss"] for r in _records(folder)]
        assert len(losses) == STEPS and losses[-1] < losses[0], (row.name, losses)
        folders[row.name] = folder
    return folders


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_layout_at_parity(references, row, tmp_path):
    reference = references[(MOE_REFERENCE if row.overrides[:2] == MOE else REFERENCE).name]
    folder = str(tmp_path / row.name)
    status = _run(row, folder)
    assert status["ok"], status["error"]
    for a, b in zip(_records(reference), _records(folder), strict=True):
        _close(a["loss"], b["loss"], f"{row.name} step {a['step']} loss")
        _close(a["grad_norm"], b["grad_norm"], f"{row.name} step {a['step']} grad_norm", GRAD_NORM_RTOL)


@pytest.mark.parametrize(
    ("flags", "world", "expected"),
    [
        (
            ["--experimental.context_parallel_degree", "2"],
            2,
            "model.name = 'qwen3_5' with experimental.context_parallel_degree",
        ),
        (
            ["--training.tensor_parallel_degree", "2", "--experimental.enable_async_tensor_parallel"],
            2,
            "model.name = 'qwen3_5' with experimental.enable_async_tensor_parallel",
        ),
    ],
)
def test_refused_in_one_line(flags, world, expected):
    from torchtitan.config.manager import JobConfig
    from torchtitan.preflight import run_preflight

    config = JobConfig.parse_args([*QWEN3_5, *flags])
    with pytest.raises((ValueError, NotImplementedError)) as info:
        run_preflight(config, world, this_machine=False)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_uneven_gated_delta_heads_are_refused_in_one_line():
    """Gated DeltaNet's heads must split over the TP ranks (the attention's are checked for every family)."""
    import dataclasses

    from torchtitan.config.manager import JobConfig
    from torchtitan.models.qwen3_5.spec import check_qwen3_5
    from torchtitan.spec import get_model_spec

    config = JobConfig.parse_args([*QWEN3_5, "--training.tensor_parallel_degree", "2"])
    args = dataclasses.replace(get_model_spec("qwen3_5").flavors["debugmodel_tiny"], linear_num_value_heads=3)
    sections = dict(model=config.model, training=config.training, experimental=config.experimental)
    with pytest.raises(ValueError) as info:
        check_qwen3_5(args, **sections)
    message = str(info.value)
    assert "does not divide model.name = 'qwen3_5'" in message and "linear_num_value_heads = 3" in message
