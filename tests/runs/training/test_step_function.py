"""The one step function: validation runs the training forward (same autocast, same loss path)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.runs import ROOT
from torchtitan.components.batch import Batch
from torchtitan.config.manager import JobConfig
from torchtitan.train import Trainer


@pytest.mark.bf16
def test_validation_runs_under_the_training_autocast(tmp_path, monkeypatch):
    """bf16 without FSDP trains under autocast; validation's loss on a batch equals the training
    forward's loss on that batch (exactly: the same path), and differs from an fp32 forward, so a
    validation that dropped the autocast would fail here."""
    monkeypatch.chdir(ROOT)
    config = JobConfig.parse_args(
        [
            "--job.config_file",
            "train_configs/debug_model.toml",
            "--job.dump_folder",
            str(tmp_path),
            "--training.mixed_precision_param",
            "bfloat16",
            "--training.seq_len",
            "32",
            "--training.batch_size",
            "2",
            "--validation.enabled",
            "--validation.steps",
            "1",
            "--training.seed",
            "5",
        ]
    )
    trainer = Trainer(config, world_size=1, rank=0)
    try:
        assert trainer.step_fn.amp_dtype == torch.bfloat16  # no FSDP: autocast carries the compute dtype
        (validation,) = trainer.parts.after_step
        validator = validation.validator
        inputs, labels = next(iter(validator.loader))
        validation_loss = validator.run()["validation_loss"]
        train_loss = trainer.step_fn.forward_backward(Batch(inputs, labels), accum_steps=1, token_weight=None).item()
        assert validation_loss == train_loss
        with torch.no_grad():
            fp32_loss = torch.nn.functional.cross_entropy(
                trainer.model_parts[0](inputs).flatten(0, 1).float(), labels.flatten(0, 1)
            ).item()
        assert abs(fp32_loss - train_loss) > 1e-4, (fp32_loss, train_loss)
    finally:
        trainer.close()


def _chat_row(user: str, answer: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})


def test_validation_loss_weighs_every_token_of_the_set_alike(tmp_path, monkeypatch):
    """Fine-tuning's validation steps hold very different numbers of trained tokens (a long answer per window in
    some, a one-word answer after a long question in others): the logged validation loss is the mean token loss
    over the whole set (summed over its steps' trained tokens, divided by their count), not a mean of the steps'
    means, and the record names the count."""
    monkeypatch.chdir(ROOT)
    words = " ".join(f"{a} plus {b} is {a + b}." for a in range(3) for b in range(4))  # ~70 tokens
    rows = [_chat_row("Say the sums.", words) for _ in range(2)] + [_chat_row(words, "Yes.") for _ in range(2)]
    val_file = tmp_path / "val.jsonl"
    val_file.write_text("\n".join(rows) + "\n")
    config = JobConfig.parse_args(
        [
            "--job.config_file",
            "train_configs/sft_debug.toml",
            "--job.dump_folder",
            str(tmp_path / "run"),
            *("--model.flavor", "debugmodel_tiny", "--training.batch_size", "1", "--training.steps", "1"),
            *("--validation.dataset_path", str(val_file), "--validation.steps", "4", "--validation.freq", "1"),
        ]
    )
    trainer = Trainer(config, world_size=1, rank=0)
    try:
        trainer.train()
        with open(tmp_path / "run" / "metrics.jsonl") as f:
            (logged,) = [r for r in map(json.loads, f) if "validation_loss" in r]
        (validation,) = trainer.parts.after_step
        validator = validation.validator
        validator.loader.load_state_dict(validator.initial_state)
        data = iter(validator.loader)
        means, counts = [], []
        for _ in range(4):  # one window a step (batch_size 1, one process)
            batch = validator.shard_batch(*next(data))
            means.append(trainer.step_fn.forward_loss(batch, token_weight=None).item())  # the training path's mean
            counts.append(int((batch.labels != -100).sum()))
    finally:
        trainer.close()
    assert max(counts) > 5 * min(counts), counts  # the steps are far apart in trained tokens
    token_mean = sum(m * n for m, n in zip(means, counts)) / sum(counts)
    mean_of_means = sum(means) / len(means)
    assert abs(mean_of_means - token_mean) > 1e-2 * token_mean, (means, counts)  # the two differ here
    assert logged["validation_loss"] == pytest.approx(token_mean, rel=1e-6, abs=0)
    assert logged["validation_tokens"] == sum(counts)
