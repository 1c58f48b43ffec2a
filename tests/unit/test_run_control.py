"""Single-process pieces of "a run that loses nothing": the step guard, stop signals, resume config, model check."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from torchtitan.checkpointing.compat import check_model_matches, warn_if_data_changed
from torchtitan.checkpointing.files.folders import find_resume_checkpoint, later_branch, set_aside
from torchtitan.checkpointing.files.marker import write_marker
from torchtitan.components.optim.optimizer import apply_optimizer_config, build_lr_scheduler, build_optimizer
from torchtitan.components.run_control import NonFiniteStep, StepGuard, StopSignals
from torchtitan.config.schema import Optimizer, Training
from torchtitan.datasets.tokenizer import tokenizer_digest

NAN, ONE = torch.tensor(float("nan")), torch.tensor(1.0)


def test_stop_policy_raises_naming_the_step():
    guard = StepGuard("stop", 3, torch.device("cpu"))
    assert not guard.check(1, ONE, ONE).skip
    with pytest.raises(NonFiniteStep, match="step 2: the loss or gradient norm is not finite"):
        guard.check(2, ONE, torch.tensor(float("inf")))


def test_skip_policy_skips_then_stops_after_n_in_a_row():
    guard = StepGuard("skip", 2, torch.device("cpu"))
    assert guard.check(1, NAN, ONE).skip
    assert not guard.check(2, ONE, ONE).skip  # a finite step resets the count
    assert guard.check(3, NAN, NAN).skip
    with pytest.raises(NonFiniteStep, match="2 steps in a row were skipped"):
        guard.check(4, NAN, ONE)
    assert guard.skipped_total == 3


def test_stop_signal_sets_a_flag_and_an_echo_is_the_same_request():
    now = [100.0]
    signals = StopSignals(clock=lambda: now[0]).install()
    try:
        guard = StepGuard("stop", 1, torch.device("cpu"), signals)
        assert not guard.check(1, ONE, ONE).stop
        os.kill(os.getpid(), signal.SIGTERM)
        now[0] += 0.5
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C's echo through torchrun: not a second request
        assert signals.requested == signal.SIGTERM
        assert guard.check(2, ONE, ONE).stop
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_resume_applies_the_configs_optimizer_settings():
    model = torch.nn.Linear(4, 4)
    old_cfg, train = Optimizer(lr=1e-3, weight_decay=0.1), Training(warmup_steps=10, steps=100)
    opt = build_optimizer([model], old_cfg)
    sched = build_lr_scheduler(opt, train)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
    saved = opt.state_dict(), sched.state_dict()
    new_cfg = Optimizer(lr=5e-3, weight_decay=0.3, beta2=0.9, eps=1e-6)
    opt2 = build_optimizer([model], new_cfg)
    sched2 = build_lr_scheduler(opt2, train)
    opt2.load_state_dict(saved[0])
    sched2.load_state_dict(saved[1])
    assert opt2.param_groups[0]["weight_decay"] == 0.1  # what a plain load leaves: the checkpoint's
    changed = apply_optimizer_config(opt2, sched2, new_cfg, [model])
    assert [c.split()[0] for c in changed] == [
        "optimizer.lr",
        "optimizer.betas",
        "optimizer.eps",
        "optimizer.weight_decay",
    ]
    group = opt2.param_groups[0]
    assert (group["weight_decay"], group["betas"], group["eps"]) == (0.3, (0.9, 0.9), 1e-6)
    assert group["lr"] == pytest.approx(5e-3 * 4 / 11) and sched2.get_last_lr() == [group["lr"]]
    sched2.step()  # the schedule goes on from the checkpoint's position with the new peak
    assert group["lr"] == pytest.approx(5e-3 * 5 / 11)


def test_model_defining_args_are_compared():
    args = {"dim": 64, "norm_type": "rmsnorm", "max_seq_len": 2048, "rope_theta": 10000.0}
    saved = {"name": "llama3", "args": args}
    check_model_matches(saved, {"name": "llama3", "args": {**args, "max_seq_len": 64}}, "ckpt")  # a buffer size
    check_model_matches(saved, {"name": "llama3", "args": {**args, "norm_type": "fused_rmsnorm"}}, "ckpt")
    # a kernel choice that follows the device (a CPU seed checkpoint resumed on CUDA), absent from older markers
    check_model_matches(saved, {"name": "llama3", "args": {**args, "attention_backend": "flex"}}, "ckpt")
    with pytest.raises(ValueError, match="norm_type: checkpoint 'rmsnorm', config 'layernorm'.*rope_theta"):
        check_model_matches(
            saved, {"name": "llama3", "args": {**args, "norm_type": "layernorm", "rope_theta": 5e5}}, "c"
        )
    check_model_matches(None, {"name": "llama3", "args": args}, "old marker")  # nothing recorded: keys still checked
    assert warn_if_data_changed({"dataset": "c4"}, {"dataset": "pydocs"}, "ckpt") == [
        "training.dataset: checkpoint 'c4', config 'pydocs'"
    ]
    # an older marker without the tokenizer's record is no change
    assert warn_if_data_changed({"dataset": "c4"}, {"dataset": "c4", "tokenizer": "/t"}, "ckpt") == []


def test_the_tokenizer_is_compared_by_content_not_by_where_it_lies(tmp_path):
    """A checkpoint records its tokenizer's path and digest; a resume says 'other data' only for other content:
    the same files in another checkout are the same tokenizer. A marker from before digests (the shipped assets')
    is compared through its recorded path where that exists here, and not at all where it does not."""
    files = {"tokenizer.json": '{"model": "x"}', "tokenizer_config.json": '{"eos_token": "<e>"}'}
    here, moved, other = tmp_path / "here", tmp_path / "moved", tmp_path / "other"
    for folder, edit in ((here, {}), (moved, {}), (other, {"tokenizer_config.json": '{"eos_token": "<f>"}'})):
        folder.mkdir()
        for name, text in {**files, **edit}.items():
            (folder / name).write_text(text)

    def record(path) -> dict:
        return {"tokenizer": str(path), "tokenizer_sha256": tokenizer_digest(str(path))}

    assert tokenizer_digest(str(here)) == tokenizer_digest(str(moved)) != tokenizer_digest(str(other))
    assert warn_if_data_changed(record(here), record(moved), "ckpt") == []
    assert warn_if_data_changed(record(other), record(moved), "ckpt") == [
        f"model.tokenizer_path: checkpoint '{other}', config '{moved}'"
    ]
    # markers from before digests: the recorded path read where it exists, else nothing to compare
    assert warn_if_data_changed({"tokenizer": str(here)}, record(moved), "ckpt") == []
    assert len(warn_if_data_changed({"tokenizer": str(other)}, record(moved), "ckpt")) == 1
    assert warn_if_data_changed({"tokenizer": "/nowhere/tokenizer"}, record(moved), "ckpt") == []


def test_set_aside_branch_is_never_resumed(tmp_path):
    root = str(tmp_path)
    for step in (2, 4, 6):
        os.makedirs(os.path.join(root, f"step-{step}"))
        write_marker(os.path.join(root, f"step-{step}"), step, "full")
    moved = set_aside(root, later_branch(root, 2), "abandoned-after-resume-from-step-2")
    assert [os.path.basename(p) for p in moved] == ["step-4", "step-6"] and all(os.path.isdir(p) for p in moved)
    assert find_resume_checkpoint(root, -1).step == 2
