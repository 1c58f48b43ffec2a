"""LoRA on the MoE families through the trainer (worker-pool jobs): loss parity, a frozen base, the estimator.

* Parity: qwen3_moe at the tiny flavor (4 experts, top 2, expert-bias balancing) with adapters (rank 4) on its
  attention linears, FSDP2 and EP2 (each rank 2 of the 4 frozen experts) against one process's LoRA run: loss
  within the matrix's RTOL (1e-5), grad norm within GRAD_NORM_RTOL.
* EP2, 6 steps, llama3_moe and deepseek_v3 (adapters on attention, the dense layer 0's FFN and the shared experts)
  and qwen3_moe (attention):
  every base weight (routed experts and router gate included) and the expert bias are bit-identical after
  training (the bias is part of the frozen base: docs/lora.md), every adapter moved, and the optimizer holds state
  for the adapters only.
* The estimator, one process: a LoRA qwen3_moe config's estimate is below full fine-tuning's (frozen experts: no
  gradients or optimizer state).
"""

from __future__ import annotations

import pytest

from tests.support.lora import check_lora_parity
from tests.support.matrix import MatrixLaunches, Row
from tests.support.pool import run_in_pool
from tests.support.rows import LORA
from tests.support.runs import GLOBAL_BATCH, trainer_argv

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2)]

EP2 = ["--experimental.expert_parallel_degree", "2"]
QWEN3_MOE = [*LORA, "--model.name", "qwen3_moe"]
LORA_MOE_REFERENCE = Row("lora_qwen3_moe_1proc", 1, GLOBAL_BATCH, QWEN3_MOE)
LORA_MOE_ROWS = [
    Row("lora_qwen3_moe_fsdp2", 2, 4, QWEN3_MOE),
    Row("lora_qwen3_moe_ep2", 2, 4, [*QWEN3_MOE, *EP2]),  # dp_shard 2 = ep 2: 2 of the 4 experts per rank
]


@pytest.mark.parametrize("row", LORA_MOE_ROWS, ids=[r.name for r in LORA_MOE_ROWS])
def test_lora_moe_loss_parity(row: Row, matrix: MatrixLaunches):
    want = check_lora_parity(row, LORA_MOE_REFERENCE, matrix)
    assert want["loss"][-1] < want["loss"][0] - 0.1, f"LoRA loss did not fall: {want['loss']}"


def _frozen_base_job(rank: int, world_size: int, argv: list[str]) -> dict:
    """Train 6 steps; what moved (whole tensors, the expert biases too) and what the optimizer holds."""
    import torch
    from torch.distributed.tensor import DTensor

    from torchtitan.config.manager import JobConfig
    from torchtitan.train import Trainer

    def full(p: torch.Tensor) -> torch.Tensor:
        return (p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()).clone()

    trainer = Trainer(JobConfig.parse_args(argv, world_size=world_size), world_size=world_size, rank=rank)
    try:
        model = trainer.model_parts[0]
        before = {n: full(p) for n, p in model.named_parameters()}
        biases = {n: full(b) for n, b in model.named_buffers() if n.endswith("expert_bias")}
        trainer.train()
        moved = {n for n, p in model.named_parameters() if not torch.equal(full(p), before[n])}
        moved |= {n for n, b in model.named_buffers() if n in biases and not torch.equal(full(b), biases[n])}
        names = {p: n for n, p in model.named_parameters()}
        with_state = {names[p] for p, s in trainer.optimizer.state.items() if s}
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        return {"moved": moved, "with_state": with_state, "frozen": frozen, "all": set(before), "biases": set(biases)}
    finally:
        trainer.close()


@pytest.mark.parametrize(("family", "adapted"), [("llama3_moe", 4 * 7), ("qwen3_moe", 4 * 4), ("deepseek_v3", 4 * 7)])
def test_lora_moe_trains_only_the_adapters(family: str, adapted: int, tmp_path):
    overrides = [*LORA, "--model.name", family, *EP2, "--training.batch_size", "4"]
    results = run_in_pool(_frozen_base_job, 2, trainer_argv(overrides, str(tmp_path / family)))
    for result in results:
        adapters = {n for n in result["all"] if ".lora_a." in n or ".lora_b." in n}
        assert len(adapters) == adapted * 2  # (A, B) per adapted linear
        assert any(".experts.w2" in n for n in result["frozen"]) and any(".router.gate." in n for n in result["frozen"])
        assert result["frozen"] == result["all"] - adapters
        assert len(result["biases"]) == (4 if family == "qwen3_moe" else 3)  # the MoE layers' (load_balance "bias")
        assert result["moved"] == adapters, sorted(result["moved"] ^ adapters)[:5]
        assert result["with_state"] == adapters


def test_lora_moe_estimate_is_below_full_fine_tuning():
    from torchtitan.config.manager import JobConfig
    from torchtitan.estimation.estimate import estimate_memory

    base = trainer_argv(["--model.name", "qwen3_moe", "--training.batch_size", "4"], "unused")[:-2]
    base += ["--validation.enabled", "false"]
    configs = {"lora": LORA, "full": []}
    peaks = {name: estimate_memory(JobConfig.parse_args([*base, *extra]), 1).peak for name, extra in configs.items()}
    print(f"qwen3_moe tiny, one process, estimates (MiB): { {k: round(v / 2**20, 2) for k, v in peaks.items()} }")
    assert peaks["lora"] < peaks["full"]
