"""Multi-token prediction through the trainer (worker-pool jobs): DeepSeek-V3 ``debugmodel_tiny`` with one MTP depth.

Rows only where the path differs from the frontier rows (tests/runs/models/test_frontier_runs.py): a 1-rank MTP
reference, FSDP2 (the depth its own FSDP unit beside the blocks), EP2 (its experts split like the blocks') and
TP2 x EP2 (the depth's own modules sequence-parallel, its block by the blocks' plan, its logits vocab-sharded under
loss parallel) and PP2 1F1B (the depth on the last stage, the tokens ahead embedded on the first and sent down) at 2
ranks against it: per-step loss, grad norm and MTP loss within RTOL, the exact expert load (the
depth's MoE included); and lambda = 0 against the frontier 1-rank reference without MTP: its losses bit for bit. One 1-rank pool job
trains from a published-layout MTP folder and exports the trained depth under its published names.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from tests.support.matrix import RTOL, MatrixLaunches, Row, check_moe_parity
from tests.support.pool import run_train_job
from tests.support.rows import FRONTIER_REFERENCES, frontier_family, pp_schedule
from tests.support.runs import GLOBAL_BATCH, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2)]

MTP = ["--model.mtp_layers", "1"]
MTP_REFERENCE = Row("dsv3_mtp_1proc", 1, GLOBAL_BATCH, [*frontier_family("deepseek_v3"), *MTP])
MTP_ROWS = [
    Row("dsv3_mtp_fsdp2", 2, 4, [*frontier_family("deepseek_v3"), *MTP]),
    Row("dsv3_mtp_ep2", 2, 4, [*frontier_family("deepseek_v3", ep=2), *MTP]),
    # the depth's own modules sequence-parallel, its block by the blocks' plan; the EP group is the TP group
    Row("dsv3_mtp_tp2_ep2", 2, 8, [*frontier_family("deepseek_v3", ep=2), *MTP], tp=2),
    # the depth on the last stage; the first stage embeds its tokens ahead and sends them down beside the hidden state
    Row("dsv3_mtp_pp2_1f1b", 2, 8, [*frontier_family("deepseek_v3"), *MTP, *pp_schedule("1F1B")], pp=2),
]
MTP_ZERO = Row(
    "dsv3_mtp0_1proc", 1, GLOBAL_BATCH, [*frontier_family("deepseek_v3"), *MTP, "--training.mtp_loss_weight", "0"]
)


def _logged(matrix: MatrixLaunches, row: Row) -> list[dict]:
    matrix.run(row)
    return [r for r in read_metrics(matrix.folder(row)) if "loss" in r]


@pytest.mark.parametrize("row", MTP_ROWS, ids=[row.name for row in MTP_ROWS])
def test_mtp_loss_parity(row: Row, matrix: MatrixLaunches):
    got, want = check_moe_parity(row, MTP_REFERENCE, matrix)
    for g, w in zip(got, want, strict=True):
        assert len(w["mtp_loss"]) == 1 and abs(g["mtp_loss"][0] - w["mtp_loss"][0]) <= RTOL * w["mtp_loss"][0], w[
            "step"
        ]
    assert want[-1]["mtp_loss"][0] < want[0]["mtp_loss"][0], [r["mtp_loss"] for r in want]


def test_mtp_weight_zero_is_the_run_without_mtp(matrix: MatrixLaunches):
    """The losses bit for bit. The logged grad norm's sum also runs over the depths' (zero) gradients, in another
    order: measured equal to 2 ulp (0.46668523 vs 0.46668527); below max_norm nothing is clipped with it."""
    got, want = _logged(matrix, MTP_ZERO), _logged(matrix, FRONTIER_REFERENCES[0])
    assert [r["loss"] for r in got] == [r["loss"] for r in want] and len(want) > 1
    assert all(abs(g["grad_norm"] - w["grad_norm"]) <= 1e-6 * w["grad_norm"] for g, w in zip(got, want, strict=True))
    assert all("mtp_loss" in r for r in got)


def test_mtp_trains_from_a_published_folder_and_exports_it(tmp_path):
    """From a published-layout folder (transformers' save plus the MTP layer): the depth loads (the sharded loader's
    layer group n_layers), trains, logs its loss and exports under its published names with the trained values."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from tests.support.hf import SHORT
    from tests.support.mtp import write_mtp_folder
    from torchtitan.checkpointing.common import load_model_weights

    hf_dir = write_mtp_folder(str(tmp_path / "hf_in"), vocab=2304)  # the shipped tokenizer's 2304 words
    folder = tmp_path / "run"
    argv = ["--job.config_file", "./train_configs/deepseek_v3_debug.toml", *SHORT, "--job.dump_folder", str(folder)]
    load = ["--checkpoint.initial_load_path", hf_dir, "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf"]
    status = run_train_job(1, [*argv, "--model.flavor", "debugmodel_tiny", *MTP, *load])
    assert status["ok"], status["error"]
    assert all(len(r["mtp_loss"]) == 1 for r in read_metrics(str(folder)) if "loss" in r)
    source = load_file(os.path.join(hf_dir, "model.safetensors"))
    (exported,) = glob.glob(str(folder / "hf" / "step-*" / "model.safetensors"))
    out = load_file(exported)
    assert out.keys() == source.keys()
    trained = load_model_weights(str(folder / "checkpoint" / "step-3"))[0]
    assert torch.equal(out["model.layers.4.eh_proj.weight"], trained["mtp.0.eh_proj.weight"])
    assert not torch.equal(out["model.layers.4.eh_proj.weight"], source["model.layers.4.eh_proj.weight"])
    assert torch.equal(out["model.layers.4.shared_head.head.weight"], out["lm_head.weight"])
