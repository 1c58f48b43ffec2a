"""The step replay (features/replay/replay.py) in one process: checksums, both policies, what it leaves as it was, refusals."""

from __future__ import annotations

import logging
import socket

import pytest
import torch
from torch import nn

from torchtitan.config.manager import JobConfig
from torchtitan.features.replay.replay import EXIT_REPLAY_MISMATCH, ReplayMismatch, StepReplay, bit_checksum
from torchtitan.preflight import run_preflight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_single_bit_flip_changes_the_checksum(dtype):
    t = torch.randn(64, dtype=dtype)
    bits = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    base = bit_checksum(t)
    assert bit_checksum(t.clone()) == base
    for bit in range(8 * t.element_size()):
        flipped = bits.clone()
        flipped[17] ^= 1 << bit if bit < 8 * t.element_size() - 1 else -(1 << bit)  # the sign bit: the int's min
        assert bit_checksum(flipped.view(dtype)) != base, bit


class _Hooks:
    def __init__(self):
        self.discarded = 0

    def discard_step(self):
        self.discarded += 1


def _setup(after_pass=None, on_mismatch="stop", every=2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    hooks = _Hooks()
    replay = StepReplay(
        every_n_steps=every,
        on_mismatch=on_mismatch,
        model_parts=[model],
        device=torch.device("cpu"),
        rank=0,
        hooks=hooks,
        after_pass=after_pass,
    )
    x = torch.randn(4, 8)

    def train_pass(scale: float) -> torch.Tensor:
        noise = torch.rand(())  # a pass that draws random numbers: the replay must draw the same
        loss = (model(x).sum() + noise) * scale
        loss.backward()
        return loss.detach()

    return model, replay, hooks, train_pass


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_a_clean_replay_changes_nothing():
    model, replay, hooks, train_pass = _setup()
    loss1 = replay.run(1, train_pass, 0.5)  # not due: one pass
    assert hooks.discarded == 0 and replay.replayed == 0
    want_grads, rng_after_one_pass = _grads(model), None
    for p in model.parameters():
        p.grad = None
    state = torch.get_rng_state()
    loss_once = train_pass(0.5)
    rng_after_one_pass = torch.get_rng_state()
    torch.set_rng_state(state)
    for p in model.parameters():
        p.grad = None
    loss2 = replay.run(2, train_pass, scale=0.5)  # due: two passes, compared
    assert replay.replayed == 1 and hooks.discarded == 1
    assert torch.equal(loss2, loss_once) and loss1.shape == loss2.shape
    assert all(torch.equal(g, w) for g, w in zip(_grads(model), want_grads, strict=True))  # not doubled
    assert torch.equal(torch.get_rng_state(), rng_after_one_pass)  # the RNG ends where one pass leaves it


def _flip(step: int, pass_number: int, params) -> None:
    if pass_number == 2:
        grad = dict(params)["1.weight"].grad
        grad.view(torch.int32)[0, 3] ^= 1  # the lowest mantissa bit
    assert step == 4


def test_a_flipped_bit_stops_in_one_line_naming_rank_host_step_and_tensor():
    model, replay, _, train_pass = _setup(after_pass=_flip)
    with pytest.raises(ReplayMismatch) as e:
        replay.run(4, train_pass, 1.0)
    message = str(e.value)
    assert "\n" not in message and e.value.exit_code == EXIT_REPLAY_MISMATCH == 6
    assert "step replay: step 4 " in message and f"rank 0 (host {socket.gethostname()})" in message
    assert "gradient of 1.weight (checksum" in message and "loss" not in message.split("rank 0")[1].split(":")[1]
    assert "stopped before the optimizer step (exit code 6)" in message


def test_warn_logs_the_line_and_goes_on(caplog):
    model, replay, _, train_pass = _setup(after_pass=_flip, on_mismatch="warn")
    with caplog.at_level(logging.WARNING):
        loss = replay.run(4, train_pass, 1.0)
    assert loss.isfinite() and replay.replayed == 1
    assert any("step replay: step 4" in r.getMessage() and "'warn'" in r.getMessage() for r in caplog.records)


def test_a_different_loss_is_named():
    model, replay, _, _ = _setup()
    losses = iter([torch.tensor(1.0), torch.tensor(1.0000001)])
    with pytest.raises(ReplayMismatch, match=r"rank 0 \(host .*\): loss 1 vs 1.00000012"):
        replay.run(2, lambda: next(losses))


FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "0"]


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ([], "training.replay_every_n_steps = 2 needs training.deterministic = true"),
        (["--training.deterministic", "--experimental.pipeline_parallel_degree", "2"], "pipeline_parallel_degree = 2"),
        (
            ["--training.deterministic", "--optimizer.early_step_in_backward", "--training.max_norm", "0"],
            "early_step_in_backward",
        ),
        (["--training.deterministic", *FT], "fault_tolerance.enable"),
    ],
)
def test_refused_combinations_are_one_line(extra, error):
    config = JobConfig.parse_args(["--training.replay_every_n_steps", "2", *extra])
    with pytest.raises((ValueError, NotImplementedError), match="replay_every_n_steps = 2") as e:
        run_preflight(config, 2, this_machine=False)
    assert error in str(e.value) and "\n" not in str(e.value)


def test_keys_in_help_and_bounds():
    from torchtitan.config.manager import format_help

    text = format_help()
    assert "training.replay_every_n_steps" in text and "silent data corruption" in text
    assert "training.on_replay_mismatch" in text
    with pytest.raises(ValueError, match="replay_every_n_steps"):
        run_preflight(JobConfig.parse_args(["--training.replay_every_n_steps", "-1"]), 1, this_machine=False)
    with pytest.raises(ValueError, match="on_replay_mismatch"):
        JobConfig.parse_args(["--training.on_replay_mismatch", "ignore"])
