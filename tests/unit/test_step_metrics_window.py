"""The per-step document statistics of a logged step are per step however the timing window was cut: a validation
(or in-loop evaluation) between two logged steps restarts the tokens/s window, not the statistics, which still
hold the steps trained before it (issue: ``trained 615/1,852`` against ~308/925 at the neighbouring steps)."""

from __future__ import annotations

from pathlib import Path

import torch

from torchtitan.config.manager import JobConfig
from torchtitan.models import ModelArgs
from torchtitan.models.common.documents import DocumentStats
from torchtitan.observability.step_metrics import StepMetrics

PER_STEP = DocumentStats(windows=4, documents=8, pairs=4 * 32 * 16, tokens=100, trained=30)


class _Feed:
    """``DocumentFeed.take_stats`` without a group: each trained step adds ``PER_STEP``; a take drains."""

    def __init__(self) -> None:
        self.steps = 0

    def train_step(self) -> None:
        self.steps += 1

    def take_stats(self) -> DocumentStats | None:
        if not self.steps:
            return None
        stats = DocumentStats(*(v * self.steps for v in PER_STEP))
        self.steps = 0
        return stats


def test_validation_between_logged_steps_keeps_tokens_per_step(tmp_path: Path) -> None:
    config = JobConfig.parse_args(["--job.dump_folder", str(tmp_path), "--training.seq_len", "32"])
    feed = _Feed()
    metrics = StepMetrics(
        metrics=config.metrics,
        training=config.training,
        float8=config.float8,
        cp_degree=1,
        dump_folder=str(tmp_path),
        device=torch.device("cpu"),
        enabled=True,
        reduce_loss=lambda loss: (loss.item(), loss.item()),
        num_params=10_000,
        model_args=ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=64),
        documents=feed.take_stats,
    )
    records = {}
    for step in range(1, 7):  # metrics.log_freq = 2, validation.freq = 3
        feed.train_step()
        metrics.add_step(128)
        if step % 2 == 0:
            records[step] = metrics.log(step, torch.tensor(2.0), torch.tensor(0.5), lr=1e-3)
        if step % 3 == 0:
            metrics.log_validation(step, {"validation_loss": 2.5, "validation_perplexity": 12.2})
    metrics.close()
    for step, record in records.items():
        assert (record["tokens_per_step"], record["trained_tokens_per_step"]) == (100, 30), (step, record)
        assert record["documents_per_window"] == 2
