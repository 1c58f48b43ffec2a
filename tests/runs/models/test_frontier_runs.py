"""The frontier MoE families through the trainer (worker-pool jobs): DeepSeek-V3 (multi-head latent attention,
group-limited sigmoid routing, a shared expert) and gpt-oss (attention sinks, sliding windows, biased
clamped-SwiGLU experts), each ``debugmodel_tiny`` at the matrix's settings against its own single-process
run: per-step loss within RTOL, grad norm within GRAD_NORM_RTOL, and the exact per-layer expert load
(both balance with the expert bias, which follows the global counts). Layouts: FSDP2, EP2 (the experts
split over the two FSDP ranks), FSDP2 x EP2 (4 ranks: each expert sharded by FSDP over 2), TP2 with EP2 (MLA's latent projections replicated, its
per-head projections and gpt-oss's sinks sharded over heads), PP2 1F1B; gpt-oss also CP2 (the ring
with its sliding window and sinks). DeepSeek-V4 (hyper-connection streams, compressed attention, hash routing) runs
FSDP2 with EP2 over the same 2 ranks, and PP2 1F1B (the streams sent between stages, the hash layer on the
first). DeepSeek-V3's EP2 row and gpt-oss's TP2 x EP2 row compile (training.compile: the
MoE blocks around their routed experts, gpt-oss's sinks as TP shards in the graph) against the same eager reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.matrix import MatrixLaunches, Row, check_moe_parity
from tests.support.pool import run_train_job
from tests.support.rows import DSV3_ROWS, DSV4_ROWS, FRONTIER_REFERENCES, GPT_OSS_ROWS

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2, 4)]


CASES = [
    *((row, FRONTIER_REFERENCES[0]) for row in DSV3_ROWS),
    *((row, FRONTIER_REFERENCES[1]) for row in GPT_OSS_ROWS),
    *((row, FRONTIER_REFERENCES[2]) for row in DSV4_ROWS),
]


@pytest.mark.parametrize(("row", "reference"), CASES, ids=[row.name for row, _ in CASES])
def test_frontier_family_loss_parity(row: Row, reference: Row, matrix: MatrixLaunches):
    got, want = check_moe_parity(row, reference, matrix)
    assert want[-1]["loss"] < want[0]["loss"], [r["loss"] for r in want]


@pytest.mark.parametrize(("name", "flavor"), [("deepseek_v3", "debugmodel_tiny"), ("gpt_oss", "debugmodel")])
def test_frontier_checkpoint_converts_to_hf_and_back(name, flavor, tmp_path, capsys):
    """A trained checkpoint (expert bias / sinks included) -> scripts/convert_to_hf.py -> transformers loads it with
    no missing or unexpected weight and the same logits (fp32, 1e-5) -> scripts/convert_from_hf.py gives back
    every weight and buffer exactly."""
    pytest.importorskip("transformers")
    from tests.support.hf import SHORT, check_export_logits
    from tests.support.scripts import script_main
    from torchtitan.checkpointing.common import load_model_weights

    folder = tmp_path / "run"
    argv = ["--job.config_file", "./train_configs/debug_model.toml", *SHORT, "--job.dump_folder", str(folder)]
    status = run_train_job(1, [*argv, "--model.name", name, "--model.flavor", flavor])
    assert status["ok"], status["error"]
    step, out, back = str(folder / "checkpoint" / "step-3"), str(tmp_path / "hf"), str(tmp_path / "back" / "step-0")
    assert script_main("convert_to_hf")([step, out]) == 0, capsys.readouterr().err
    check_export_logits(f"{name} {flavor}", step, out)
    assert script_main("convert_from_hf")([out, back]) == 0, capsys.readouterr().err
    trained, imported = load_model_weights(step)[0], load_model_weights(back)[0]
    assert trained.keys() == imported.keys()
    assert all(torch.equal(trained[k], imported[k]) for k in trained), [
        k for k in trained if not torch.equal(trained[k], imported[k])
    ]
