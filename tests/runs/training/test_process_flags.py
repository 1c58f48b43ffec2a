"""The process-wide flags a run changes (``ProcessFlags``: deterministic kernels, cudnn, oneDNN, inductor's async-TP
pass) are put back when the run is done, so a second run in the same process does not inherit them: after a
trainer's build fails, and after an in-process memory estimate (whose trainer is never closed). A closed trainer's
restore is checked through the GPU check's runs (tests/runs/launch/test_gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from torchtitan.config.manager import JobConfig
from torchtitan.distributed.backend.device import ProcessFlags

ARGV = ["--job.config_file", "train_configs/debug_model.toml", "--training.deterministic"]


@pytest.fixture
def nondeterministic():
    """Deterministic kernels off for the test (an earlier test in this process may have left them on), then back."""
    found = ProcessFlags.read()
    torch.use_deterministic_algorithms(False)
    yield
    found.restore()


def test_a_trainer_whose_build_fails_puts_the_flags_back(nondeterministic, tmp_path):
    """Restored when the build raises after ``set_determinism`` (here: the tokenizer, built right after it)."""
    from torchtitan.engine.builders import Builders
    from torchtitan.train import Trainer

    def tokenizer_that_fails(model) -> None:
        assert torch.are_deterministic_algorithms_enabled()  # set_determinism ran first
        raise FileNotFoundError("no tokenizer here")

    config = JobConfig.parse_args([*ARGV, "--job.dump_folder", str(tmp_path)], world_size=1)
    with pytest.raises(FileNotFoundError, match="no tokenizer here"):
        Trainer(config, world_size=1, rank=0, builders=Builders(tokenizer=tokenizer_that_fails))
    assert not torch.are_deterministic_algorithms_enabled()


def test_an_in_process_estimate_puts_the_flags_back(nondeterministic, tmp_path):
    from torchtitan.estimation.estimate import estimate_memory

    argv = [*ARGV, "--model.flavor", "debugmodel_tiny", "--job.dump_folder", str(tmp_path)]
    estimate = estimate_memory(JobConfig.parse_args(argv), 1)
    assert estimate.peak > 0
    assert not torch.are_deterministic_algorithms_enabled()
