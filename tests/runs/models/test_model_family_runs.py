"""Model families and flavors beyond the plain debug model, through the trainer: loss parity per layout.

* Tied embeddings (``debugmodel_tied_tiny``: Llama 3.2's head tied to the embedding, RoPE scaled from a
  64-token original context): FSDP2, TP2 (both shard the one table over the vocab: Shard(0)) and
  DDP against the single-process run of the same flavor, within the matrix's RTOL (and the grad norm
  within GRAD_NORM_RTOL). These rows are worker-pool jobs (the reference a 1-rank one).
* Qwen3 (``model.name = "qwen3"``, debugmodel_tiny: QK-norm, head_dim 32 != dim / n_heads): FSDP2, TP2 (the
  q/k norms' replicated weights on each rank's heads), PP2 1F1B and CP2 against its single-process run.
* Qwen3-MoE (``model.name = "qwen3_moe"``, debugmodel_tiny: 4 experts, top 2, softmax renormalised, expert-
  bias balancing): EP2 and FSDP2 x EP2 against its single-process run.
"""

from __future__ import annotations

import pytest

from tests.support.matrix import GRAD_NORM_RTOL, RTOL, MatrixLaunches, Row, check_grad_norms, check_row
from tests.support.rows import (
    QWEN3_MOE_REFERENCE,
    QWEN3_MOE_ROWS,
    QWEN3_REFERENCE,
    QWEN3_ROWS,
    TIED_REFERENCE,
    TIED_ROWS,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("row", "twin"), [(r, TIED_REFERENCE) for r in TIED_ROWS], ids=[r.name for r in TIED_ROWS])
def test_tied_embedding_loss_parity(row: Row, twin: Row, matrix: MatrixLaunches):
    check_row(row)
    got, want = matrix.losses(row), matrix.losses(twin)
    losses, ref = got["loss"], want["loss"]
    gaps = [abs(g - w) / abs(w) for g, w in zip(losses, ref, strict=True)]
    print(row.name, "gap to one process", [f"{g:.2e}" for g in gaps])
    assert max(gaps) <= RTOL, f"{row.name}: {losses} vs single-process {ref}"
    check_grad_norms(row.name, got["grad_norm"], want["grad_norm"], GRAD_NORM_RTOL)


@pytest.mark.parametrize(("row", "twin"), [(r, QWEN3_REFERENCE) for r in QWEN3_ROWS], ids=[r.name for r in QWEN3_ROWS])
def test_qwen3_loss_parity(row: Row, twin: Row, matrix: MatrixLaunches):
    test_tied_embedding_loss_parity(row, twin, matrix)


@pytest.mark.parametrize(
    ("row", "twin"), [(r, QWEN3_MOE_REFERENCE) for r in QWEN3_MOE_ROWS], ids=[r.name for r in QWEN3_MOE_ROWS]
)
def test_qwen3_moe_loss_parity(row: Row, twin: Row, matrix: MatrixLaunches):
    test_tied_embedding_loss_parity(row, twin, matrix)
