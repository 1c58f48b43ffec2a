"""DeepSeek-V3.2's sparse attention through the trainer (worker-pool jobs): ``debugmodel_tiny`` (each query keeps 16
of the 64 tokens) in the sparse stage and in the dense warm-up (``model.dsa_stage = "dense_warmup"``: dense attention, only the
indexers train), each
FSDP2 at 2 ranks against its own single-process run: per-step loss within RTOL, grad norm within GRAD_NORM_RTOL (the
indexers' KL loss is in the backward, so in the warm-up the grad norm is the indexers' alone), the same expert load,
the logged ``indexer_loss`` within INDEXER_ATOL.

The warm-up row is the path no other row takes: every block's own parameters frozen but its indexer's, so FSDP's
hooks must still gather each block for its indexer's backward (models/deepseek_v32/model.py ``_RequireGrad``). The
other layouts DSA runs under (expert parallel, HSDP, accumulation) change nothing in its attention: they ride on
deepseek_v3's rows; CP, TP and PP are refused before launch (tests/unit/test_deepseek_v32.py).
"""

from __future__ import annotations

import pytest

from tests.support.matrix import MatrixLaunches, Row, check_moe_parity
from tests.support.rows import frontier_family
from tests.support.runs import GLOBAL_BATCH

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2)]

WARMUP = ["--model.dsa_stage", "dense_warmup"]
DSA_REFERENCES = [
    Row("dsv32_1proc", 1, GLOBAL_BATCH, frontier_family("deepseek_v32")),
    Row("dsv32_warmup_1proc", 1, GLOBAL_BATCH, [*frontier_family("deepseek_v32"), *WARMUP]),
]
DSA_ROWS = [
    Row("dsv32_fsdp2", 2, 4, frontier_family("deepseek_v32")),
    Row("dsv32_warmup_fsdp2", 2, 4, [*frontier_family("deepseek_v32"), *WARMUP]),
]
# The KL is a difference of fp32 sums of p * log p terms of size up to log(64) ~ 4.2 before it cancels to 1e-4..1e-2,
# averaged over queries and micro-batches: a layout's other summation order moves it by absolute amounts (measured
# at most 9.3e-9 over both rows' 6 steps, the same at 2e-4 as at 2.5e-2), under one fp32 ulp (4.8e-7) of the terms.
INDEXER_ATOL = 1e-7
CASES = list(zip(DSA_ROWS, DSA_REFERENCES, strict=True))


@pytest.mark.parametrize(("row", "reference"), CASES, ids=[row.name for row, _ in CASES])
def test_dsa_loss_parity(row: Row, reference: Row, matrix: MatrixLaunches):
    got, want = check_moe_parity(row, reference, matrix)
    # The indexers' term, logged: the same mean over the global batch within INDEXER_ATOL (its size runs from 2e-4
    # in the warm-up to 3e-2: an absolute bound, see there).
    for g, w in zip(got, want, strict=True):
        assert w["indexer_loss"] > 0 and abs(g["indexer_loss"] - w["indexer_loss"]) <= INDEXER_ATOL, (g, w)
    print(f"\n{row.name}: losses {[round(r['loss'], 4) for r in want]}, grad norms {[r['grad_norm'] for r in want]}")
    if "warmup" not in row.name:
        assert want[-1]["loss"] < want[0]["loss"], [r["loss"] for r in want]
