"""The one step function: validation runs the training forward (same autocast, same loss path)."""

from __future__ import annotations

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
