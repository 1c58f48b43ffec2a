"""activation_checkpoint.mode = "memory_budget": its keys and refusals, and the budget set for the blocks' compile only.

What it trains and saves (against the eager run; the estimator's stand-in) is tests/runs/training/test_memory_options.py;
the estimate against the tracker on the real step, tests/runs/estimation/test_estimation.py (fsdp2_memory_budget).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch._inductor
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig, format_help
from torchtitan.config.schema import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac, compile_backend
from torchtitan.estimation.estimate import check_estimable
from torchtitan.preflight import run_preflight

BASE = ["--job.config_file", "train_configs/debug_model.toml"]
BUDGET = ["--activation_checkpoint.mode", "memory_budget"]


def _preflight(*args: str) -> list[str]:
    return run_preflight(JobConfig.parse_args([*BASE, *args]), 1, this_machine=False)


def test_refused_without_compile_in_one_line():
    with pytest.raises(ConfigError, match=r"mode = 'memory_budget' needs training.compile = true") as e:
        _preflight(*BUDGET)
    assert "\n" not in str(e.value)
    assert _preflight(*BUDGET, "--training.compile") == []


@pytest.mark.parametrize("budget", ["-0.1", "1.5", "nan"])
def test_a_budget_outside_0_to_1_is_refused(budget):
    with pytest.raises(ConfigError, match=r"activation_checkpoint.memory_budget must be") as e:
        _preflight(*BUDGET, "--training.compile", "--activation_checkpoint.memory_budget", budget)
    assert "\n" not in str(e.value)
    if budget != "nan":
        assert str(e.value) == f"activation_checkpoint.memory_budget must be >= 0 and <= 1, got {float(budget)}"


def test_the_edges_pass_and_a_budget_for_another_mode_is_said_to_do_nothing():
    for edge in ("0", "1"):
        assert _preflight(*BUDGET, "--training.compile", "--activation_checkpoint.memory_budget", edge) == []
    (warning,) = _preflight("--activation_checkpoint.mode", "full", "--activation_checkpoint.memory_budget", "0.3")
    assert warning.startswith("activation_checkpoint.memory_budget = 0.3 has no effect with mode = 'full'")


def test_help_names_the_range():
    assert "--activation_checkpoint.memory_budget (float, default 0.5, >= 0 and <= 1)" in format_help()


def test_no_block_is_wrapped():
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Linear(2, 2), "1": nn.Linear(2, 2)})
    apply_ac(model, ActivationCheckpoint(mode="memory_budget"))
    assert all(type(block) is nn.Linear for block in model.layers.values())


def test_the_budget_is_set_while_a_block_compiles_and_only_then(monkeypatch):
    """The partitioner reads torch._functorch.config.activation_memory_budget inside inductor's compile of a block; the
    backend sets it around that call and leaves the process's value as it was."""
    seen = []
    # inductor's compile_fx module stands in (importing the real one takes seconds)
    inductor = types.SimpleNamespace(
        compile_fx=lambda gm, inputs: seen.append(torch._functorch.config.activation_memory_budget)
    )
    monkeypatch.setitem(sys.modules, "torch._inductor.compile_fx", inductor)
    monkeypatch.setattr(torch._inductor, "compile_fx", inductor, raising=False)
    before = torch._functorch.config.activation_memory_budget
    compile_backend(ActivationCheckpoint(mode="memory_budget", memory_budget=0.25))(None, [])
    assert seen == [0.25] and torch._functorch.config.activation_memory_budget == before == 1.0
    assert compile_backend(ActivationCheckpoint(mode="full")) == "inductor"


def test_the_estimator_models_compile_for_this_mode_only():
    check_estimable(JobConfig.parse_args([*BASE, *BUDGET, "--training.compile"]), 1)
    with pytest.raises(NotImplementedError, match="training.compile = True is not modeled"):
        check_estimable(JobConfig.parse_args([*BASE, "--training.compile"]), 1)
