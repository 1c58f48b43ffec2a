"""LoRA through the trainer (worker-pool jobs): loss parity per layout, a frozen base, adapter-only state.

* Parity: llama3 and qwen3 at the tiny flavor with adapters (rank 4) on every block linear; FSDP2, TP2 (each
  adapter sharded like its base linear: distributed/lora_tp.py), PP2 1F1B and FSDP2 with gradient
  accumulation 2 against one process's LoRA run, loss within the matrix's RTOL (1e-5) and grad norm within
  GRAD_NORM_RTOL. LoRA runs are compared with LoRA runs: their losses are not the full fine-tuning rows'.
* The one-process run's losses fall; with lora.enable the step-1 loss equals the full run's exactly (B = 0).
* TP2, in the pool: after 6 steps every base weight is bit-identical to its initial value, every
  adapter moved, and the optimizer holds state for the adapters only.
"""

from __future__ import annotations

import pytest

from tests.integration_tests import (
    GLOBAL_BATCH,
    GRAD_NORM_RTOL,
    RTOL,
    MatrixLaunches,
    Row,
    check_grad_norms,
    check_row,
    pp_schedule,
    trainer_argv,
)
from tests.pool import run_in_pool

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2)]

LORA = ["--lora.enable", "--lora.rank", "4", "--lora.alpha", "32"]
ACCUM2 = ["--training.gradient_accumulation_steps", "2"]


def _rows(family: str) -> tuple[Row, list[Row]]:
    args = [*LORA, "--model.name", family]
    reference = Row(f"lora_{family}_1proc", 1, GLOBAL_BATCH, args)
    return reference, [
        Row(f"lora_{family}_fsdp2", 2, 4, args),
        Row(f"lora_{family}_tp2", 2, 8, args, tp=2),
        Row(f"lora_{family}_pp2_1f1b", 2, 8, [*args, *pp_schedule("1F1B")], pp=2),
        Row(f"lora_{family}_fsdp2_accum2", 2, 2, [*args, *ACCUM2]),
    ]


LLAMA_REFERENCE, LLAMA_ROWS = _rows("llama3")
QWEN3_REFERENCE, QWEN3_ROWS = _rows("qwen3")
LORA_REFERENCES = [LLAMA_REFERENCE, QWEN3_REFERENCE]  # counted by the rank-row budget
LORA_ROWS = [*LLAMA_ROWS, *QWEN3_ROWS]
PAIRS = [(r, LLAMA_REFERENCE) for r in LLAMA_ROWS] + [(r, QWEN3_REFERENCE) for r in QWEN3_ROWS]


@pytest.mark.parametrize(("row", "reference"), PAIRS, ids=[r.name for r, _ in PAIRS])
def test_lora_loss_parity(row: Row, reference: Row, matrix: MatrixLaunches):
    check_row(row)
    got, want = matrix.losses(row), matrix.losses(reference)
    gaps = [abs(g - w) / abs(w) for g, w in zip(got["loss"], want["loss"], strict=True)]
    print(row.name, "gap to one process", [f"{g:.2e}" for g in gaps])
    assert max(gaps) <= RTOL, f"{row.name}: {got['loss']} vs single-process {want['loss']}"
    check_grad_norms(row.name, got["grad_norm"], want["grad_norm"], GRAD_NORM_RTOL)


def test_lora_reference_learns_from_the_base(matrix: MatrixLaunches, reference: dict[str, list[float]]):
    lora = matrix.losses(LLAMA_REFERENCE)["loss"]
    assert lora[0] == reference["loss"][0], "step 1 (B = 0) should be the base model's loss exactly"
    assert lora[-1] < lora[0] - 0.1, f"LoRA loss did not fall: {lora}"
    assert lora[-1] != reference["loss"][-1]  # it trained something else than the full model


def _frozen_base_job(rank: int, world_size: int, argv: list[str]) -> dict:
    """Train 6 steps on these ranks; what moved (whole tensors) and what the optimizer holds."""
    import torch
    from torch.distributed.tensor import DTensor

    from torchtitan.config.manager import JobConfig
    from torchtitan.train import Trainer

    def full(p: torch.Tensor) -> torch.Tensor:
        return (p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()).clone()  # a Replicate one is a view

    trainer = Trainer(JobConfig.parse_args(argv, world_size=world_size), world_size=world_size, rank=rank)
    try:
        model = trainer.model_parts[0]
        before = {n: full(p) for n, p in model.named_parameters()}
        trainer.train()
        moved = {n for n, p in model.named_parameters() if not torch.equal(full(p), before[n])}
        names = {p: n for n, p in model.named_parameters()}
        with_state = {names[p] for p, s in trainer.optimizer.state.items() if s}
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        return {"moved": moved, "with_state": with_state, "frozen": frozen, "all": set(before)}
    finally:
        trainer.close()


def test_lora_trains_only_the_adapters(tmp_path):
    """Under TP2 (torch's SequenceParallel re-creates the norms' weights trainable; they must stay frozen)."""
    overrides = [*LORA, "--training.batch_size", str(GLOBAL_BATCH), "--training.tensor_parallel_degree", "2"]
    results = run_in_pool(_frozen_base_job, 2, trainer_argv(overrides, str(tmp_path / "frozen")))
    for result in results:
        adapters = {n for n in result["all"] if ".lora_a." in n or ".lora_b." in n}
        assert len(adapters) == 4 * 7 * 2  # 4 layers x 7 linears x (A, B)
        assert result["frozen"] == result["all"] - adapters
        assert result["moved"] == adapters, sorted(result["moved"] ^ adapters)[:5]
        assert result["with_state"] == adapters
