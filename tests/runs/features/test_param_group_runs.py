"""Parameter groups through the trainer (issue 47): loss parity of FSDP2, TP2 and PP2 (1F1B) with one process.

The rules ride on the matrix's settings (clipping at max_norm 1, FSDP2's row with gradient accumulation 2) (worker-pool jobs like tests/runs/training/test_parity_matrix.py's): the no-decay
preset, the embedding at half the lr with other betas, Muon for the feed-forward matrices (its full-matrix
step on FSDP's and TP's shards; on a pipeline stage each stage's own optimizer) and AdamW for the rest. The
names are canonical, so the same rules give the same groups on every layout and stage; the one-process run is
the reference, the layouts differ from it only in the order of their reductions (RTOL, as the matrix).
Single-process equality with hand-built torch optimizers: tests/unit/test_param_groups.py, tests/unit/test_muon.py.
"""

from __future__ import annotations

import pytest

from tests.support.matrix import GRAD_NORM_RTOL, RTOL, MatrixLaunches, Row, check_row, pp_schedule
from tests.support.runs import GLOBAL_BATCH, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.pool(2)]

RULES = (
    '[{pattern = "^tok_embeddings\\\\.", lr_multiplier = 0.5, betas = [0.8, 0.9]}, '
    '{pattern = "feed_forward\\\\.w\\\\d", optimizer = "Muon"}, {pattern = ".*"}]'
)
GROUPS = ["--optimizer.no_decay", "norm,bias,embedding", "--optimizer.param_groups", RULES]
PG_REFERENCE = Row("pg_1proc", 1, GLOBAL_BATCH, GROUPS)
PG_ROWS = [
    Row("pg_fsdp2_grad_accum2", 2, 2, [*GROUPS, "--training.gradient_accumulation_steps", "2"]),
    Row("pg_tp2", 2, 8, GROUPS, tp=2),
    Row("pg_pp2_1f1b", 2, 8, [*GROUPS, *pp_schedule("1F1B")], pp=2),
]


def _records(matrix: MatrixLaunches, row: Row) -> list[dict]:
    matrix.losses(row)
    return [r for r in read_metrics(matrix.folder(row)) if "loss" in r]


@pytest.mark.parametrize("row", PG_ROWS, ids=[r.name for r in PG_ROWS])
def test_param_groups_loss_parity(row: Row, matrix: MatrixLaunches):
    check_row(row)
    got, want = _records(matrix, row), _records(matrix, PG_REFERENCE)
    gaps = [abs(g["loss"] - w["loss"]) / abs(w["loss"]) for g, w in zip(got, want, strict=True)]
    print(row.name, "gap to one process", [f"{g:.1e}" for g in gaps])
    assert max(gaps) <= RTOL, f"{row.name}: {[g['loss'] for g in got]} vs one process {[w['loss'] for w in want]}"
    for g, w in zip(got, want, strict=True):
        assert abs(g["grad_norm"] - w["grad_norm"]) <= GRAD_NORM_RTOL * w["grad_norm"], (g, w)
    log = matrix.run(PG_REFERENCE)
    assert "optimizer param groups" in log and "Muon" in log and "lr=0.005" in log  # the start table
