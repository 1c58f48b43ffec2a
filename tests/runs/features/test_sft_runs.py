"""Supervised fine-tuning through the trainer (worker-pool jobs): the masked loss at parity, and resume.

* Parity: chat rows of the shipped task (tests/assets/sft), packed several to a 128-token window with
  block-causal masking and per-example positions, the loss on the assistant turns only. The per-step
  loss, the validation loss (the held-out file, masked alike) and the grad norm of FSDP2, TP2, PP2
  (1F1B), CP2 and FSDP2 with gradient accumulation 2 equal one process's within the matrix's RTOL,
  and the windows and trained tokens per step are the same numbers in every layout. ``loss_on =
  'all'`` gives another loss (so the mask is doing something).
* Resume mid-epoch: a data file cut so one epoch is exactly 8 steps of the global batch; a 2-rank run
  saves at step 12 (step 4 of epoch 2) and goes on to 16; resuming its step-12 checkpoint gives steps
  13-16 bit-exact, and on one process (another data-parallel layout) within RTOL.
* A bad row fails every rank with one line naming the file and the row.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.support.matrix import (
    GRAD_NORM_RTOL,
    ROTATE_ALLGATHER,
    RTOL,
    MatrixLaunches,
    Row,
    check_grad_norms,
    check_row,
    pp_schedule,
)
from tests.support.pool import run_train_job
from tests.support.rows import SFT_ASSETS, SFT_TRAIN
from tests.support.runs import GLOBAL_BATCH, VALIDATION, read_metrics, train, trainer_argv

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2)]

SFT = [*SFT_TRAIN, "--validation.dataset", "sft_arith_val", *VALIDATION]
SFT_REFERENCE = Row("sft_1proc", 1, GLOBAL_BATCH, SFT)
SFT_ROWS = [
    Row("sft_fsdp2", 2, 4, SFT),
    Row("sft_tp2", 2, 8, SFT, tp=2),
    Row("sft_pp2_1f1b", 2, 8, [*SFT, *pp_schedule("1F1B")], pp=2),
    Row("sft_cp2", 2, 8, [*SFT, *ROTATE_ALLGATHER], cp=2),
    Row("sft_fsdp2_accum2", 2, 2, [*SFT, "--training.gradient_accumulation_steps", "2"]),
]
SFT_ALL_TOKENS = Row("sft_1proc_loss_on_all", 1, GLOBAL_BATCH, [*SFT, "--training.loss_on", "all"])
SFT_REFERENCES = [SFT_REFERENCE, SFT_ALL_TOKENS]  # counted by the rank-row budget


def _records(matrix: MatrixLaunches, row: Row) -> list[dict]:
    matrix.run(row)
    return [r for r in read_metrics(matrix.folder(row)) if "loss" in r]


def test_sft_reference_packs_several_examples_and_masks(matrix: MatrixLaunches):
    records = _records(matrix, SFT_REFERENCE)
    docs = [r["documents_per_window"] for r in records]
    assert min(docs) >= 2.0, f"windows should hold several examples each: {docs}"
    for r in records:
        # padding is not a token seen, and only assistant tokens are trained
        assert 0 < r["trained_tokens_per_step"] < r["tokens_per_step"] <= GLOBAL_BATCH * 128, r
    masked, everything = matrix.losses(SFT_REFERENCE), matrix.losses(SFT_ALL_TOKENS)
    gaps = [abs(a - b) / b for a, b in zip(masked["loss"], everything["loss"], strict=True)]
    # step 1 has the same weights, so only the mask differs; later steps also differ beyond the parity tolerance
    assert gaps[0] > 1e-2 and min(gaps) > RTOL, f"loss_on='all' should give another loss: {masked} vs {everything}"
    trained_all = [r["trained_tokens_per_step"] for r in _records(matrix, SFT_ALL_TOKENS)]
    assert all(a > r["trained_tokens_per_step"] for a, r in zip(trained_all, records, strict=True))


@pytest.mark.parametrize("row", SFT_ROWS, ids=[r.name for r in SFT_ROWS])
def test_sft_masked_loss_parity(row: Row, matrix: MatrixLaunches):
    check_row(row)
    got, want = matrix.losses(row), matrix.losses(SFT_REFERENCE)
    for key in ("loss", "validation_loss"):
        assert want[key], key
        for i, (g, w) in enumerate(zip(got[key], want[key], strict=True)):
            assert abs(g - w) <= RTOL * abs(w), f"{key} #{i}: {row.name} {g} vs single-process {w}"
    check_grad_norms(row.name, got["grad_norm"], want["grad_norm"], GRAD_NORM_RTOL)
    # the same windows in every layout: documents and tokens are functions of the global batch
    fields = ("documents_per_window", "tokens_per_step", "trained_tokens_per_step")
    mine = [[r[f] for f in fields] for r in _records(matrix, row)]
    theirs = [[r[f] for f in fields] for r in _records(matrix, SFT_REFERENCE)]
    assert mine == theirs, (mine, theirs)


# ---- resume mid-epoch ----

RESUME_STEPS, SAVE_AT, EPOCH_STEPS = 16, 12, 8


def _rows_for_windows(windows: int, seq_len: int) -> list[str]:
    """The shortest prefix of the shipped chat rows whose epoch packs into exactly ``windows`` windows."""
    from torchtitan.datasets.sft.chat_template import ChatTokenizer
    from torchtitan.datasets.sft.examples import build_example
    from torchtitan.datasets.sft.packing import plan_packing

    tokenizer = ChatTokenizer(f"{SFT_ASSETS}/tokenizer")
    with open(f"{SFT_ASSETS}/arith_train.jsonl") as f:
        lines = f.read().splitlines()
    examples = [build_example(json.loads(line), tokenizer) for line in lines]
    for n in range(1, len(lines) + 1):
        if plan_packing(examples[:n], seq_len=seq_len).stats.windows == windows:
            return lines[:n]
    raise AssertionError(f"no prefix of the shipped rows packs into exactly {windows} windows")


def test_sft_resume_mid_epoch_is_bit_exact(tmp_path):
    data = tmp_path / "epoch_of_8_steps.jsonl"
    data.write_text("\n".join(_rows_for_windows(EPOCH_STEPS * GLOBAL_BATCH, 128)) + "\n")
    args = [
        *SFT_TRAIN,
        "--training.dataset_path",
        str(data),
        "--training.steps",
        str(RESUME_STEPS),
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        str(SAVE_AT),
    ]
    whole = str(tmp_path / "whole")
    run = train(2, whole, ["--training.batch_size", "4", *args])
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"({EPOCH_STEPS * GLOBAL_BATCH} windows)" in run.stderr and "epoch 1 " in run.stderr, run.stderr[-3000:]
    want = {r["step"]: r["loss"] for r in read_metrics(whole) if "loss" in r}
    assert sorted(want) == list(range(1, RESUME_STEPS + 1))
    for ngpu, batch, exact in ((2, 4, True), (1, 8, False)):
        resumed = str(tmp_path / f"resumed_{ngpu}")
        os.makedirs(os.path.join(resumed, "checkpoint"))
        shutil.copytree(
            os.path.join(whole, "checkpoint", f"step-{SAVE_AT}"),
            os.path.join(resumed, "checkpoint", f"step-{SAVE_AT}"),
        )
        run = train(ngpu, resumed, ["--training.batch_size", str(batch), *args])
        assert run.returncode == 0, run.stderr[-3000:]
        got = {r["step"]: r["loss"] for r in read_metrics(resumed) if "loss" in r}
        assert sorted(got) == list(range(SAVE_AT + 1, RESUME_STEPS + 1)), got
        for step, loss in got.items():
            if exact:
                assert loss == want[step], f"step {step}: resumed {loss} vs uninterrupted {want[step]}"
            else:
                assert abs(loss - want[step]) <= RTOL * abs(want[step]), (step, loss, want[step])


def test_sft_bad_row_fails_every_rank_in_one_line(tmp_path):
    good = {"messages": [{"role": "user", "content": "What is 1 plus 2?"}, {"role": "assistant", "content": "3"}]}
    bad = {"messages": [{"role": "user", "content": "What is 1 plus 2?"}, {"role": "robot", "content": "3"}]}
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [good, good, good, bad]))
    folder = str(tmp_path / "run")
    says = f"{data}: row 3: message 1 has unknown role 'robot'; allowed: system, user, assistant"
    status = run_train_job(
        2, trainer_argv([*SFT_TRAIN, "--training.dataset_path", str(data)], folder), expect_error=says
    )
    assert status["ok"], status["error"]
    # a ValueError whose message is that one line: the launcher prints it alone (train.USER_ERRORS)
    assert status["error"].strip().splitlines()[-1] == f"ValueError: {says}", status["error"]
