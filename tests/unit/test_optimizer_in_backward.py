"""The optimizer step in backward (features/in_backward/in_backward.py) on one process, and its refusals.

Multi-rank layouts (FSDP2, PP, CPU offload, TP), resume and memory: tests/runs/features/test_optimizer_in_backward_runs.py.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from torchtitan.components.optim.optimizer import build_lr_scheduler, build_optimizer
from torchtitan.config.manager import JobConfig
from torchtitan.config.schema import Optimizer as OptimizerConfig
from torchtitan.features.in_backward.in_backward import build_optimizer_in_backward
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.preflight import run_preflight

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=64)


def _train(model, optimizer, scheduler, in_backward, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, TINY.vocab_size, (2, 17), generator=g)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if in_backward is None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            assert all(p.grad is None for p in model.parameters()), "the hooks free every gradient"
            in_backward.finish_step()
        scheduler.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_equals_the_regular_step_under_the_lr_schedule(state_dtype):
    """Same losses, weights and state, bit for bit, with a warmup + decay schedule driving both."""
    torch.manual_seed(0)
    model = Transformer(TINY)
    model.init_weights()
    twin = copy.deepcopy(model)
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    training = dataclasses.replace(JobConfig().training, warmup_steps=2, steps=6)
    regular = build_optimizer([model], config)
    regular_lr = build_lr_scheduler(regular, training)
    main = build_optimizer([twin], config)
    main_lr = build_lr_scheduler(main, training)
    hooks = build_optimizer_in_backward(main, config, pipeline_microbatches=1, fsdp=False, pp_group=None)
    want = _train(model, regular, regular_lr, None, 6)
    got = _train(twin, main, main_lr, hooks, 6)
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    # the whole-model optimizer holds the state, as the regular one does: checkpoints look the same
    assert regular.state_dict()["param_groups"] == main.state_dict()["param_groups"]
    for pa, pb in zip(model.parameters(), twin.parameters(), strict=True):
        sa, sb = regular.state[pa], main.state[pb]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_loaded_state_is_what_the_hooks_step_with():
    """Loading a state dict replaces the optimizer's ``state`` object; the hooks must use the new one."""
    torch.manual_seed(0)
    model = Transformer(TINY)
    model.init_weights()
    twin = copy.deepcopy(model)
    config = OptimizerConfig(lr=1e-2)
    training = dataclasses.replace(JobConfig().training, warmup_steps=0, steps=4)
    regular = build_optimizer([model], config)
    _train(model, regular, build_lr_scheduler(regular, training), None, 2)
    main = build_optimizer([twin], config)
    hooks = build_optimizer_in_backward(main, config, pipeline_microbatches=1, fsdp=False, pp_group=None)
    twin.load_state_dict(model.state_dict())
    main.load_state_dict(copy.deepcopy(regular.state_dict()))  # load shares tensors otherwise
    regular_lr, main_lr = build_lr_scheduler(regular, training), build_lr_scheduler(main, training)
    assert _train(twin, main, main_lr, hooks, 2) == _train(model, regular, regular_lr, None, 2)


def test_a_gradient_no_hook_stepped_is_an_error():
    model = torch.nn.Linear(4, 4)
    config = OptimizerConfig()
    hooks = build_optimizer_in_backward(
        build_optimizer([model], config), config, pipeline_microbatches=2, fsdp=False, pp_group=None
    )
    model(torch.ones(1, 4)).sum().backward()  # one of the two micro-batches the hooks wait for
    with pytest.raises(RuntimeError, match="unexpected number of gradient accumulations"):
        hooks.finish_step()


IB = ["--optimizer.early_step_in_backward", "--training.max_norm", "0"]


@pytest.mark.parametrize(
    "args, world, match",
    [
        (["--optimizer.early_step_in_backward"], 1, "training.max_norm = 1.0: clipping needs the total"),
        ([*IB, "--training.gradient_accumulation_steps", "2"], 1, "gradient_accumulation_steps = 2"),
        ([*IB, "--training.on_nonfinite", "skip"], 1, "on_nonfinite = 'skip'"),
        (
            [*IB, "--training.data_parallel_replicate_degree", "2", "--training.data_parallel_shard_degree", "1"],
            2,
            "DDP",
        ),
        (
            [*IB, "--experimental.pipeline_parallel_degree", "2"]
            + ["--experimental.pipeline_parallel_schedule", "ZBVZeroBubble"],
            2,
            "zero-bubble schedules",
        ),
        (
            [*IB, "--experimental.pipeline_parallel_degree", "2"]
            + ["--experimental.pipeline_parallel_schedule", "PipelineScheduleSingle"]
            + ["--experimental.pipeline_parallel_schedule_csv", "SPLIT_CSV"],
            2,
            "its CSV has I/W actions",
        ),
    ],
    ids=["max-norm", "grad-accum", "skip", "ddp", "zero-bubble", "csv-with-w"],
)
def test_what_cannot_compose_is_refused_before_launch(args, world, match, monkeypatch, tmp_path):
    monkeypatch.chdir(_ROOT)
    split = tmp_path / "split.csv"
    split.write_text("0F0,0F1,0I0,0I1,0W0,0W1\n1F0,1I0,1W0,1F1,1I1,1W1\n")
    args = [str(split) if a == "SPLIT_CSV" else a for a in args]
    config = JobConfig.parse_args(["--job.config_file", "train_configs/debug_model.toml", *args])
    with pytest.raises(NotImplementedError, match=match):
        run_preflight(config, world, this_machine=False)


def test_what_composes_passes(monkeypatch):
    monkeypatch.chdir(_ROOT)
    for args, world in (
        (IB, 1),
        ([*IB, "--experimental.pipeline_parallel_degree", "2", "--experimental.pipeline_parallel_schedule", "1F1B"], 2),
        ([*IB, "--training.data_parallel_replicate_degree", "2", "--training.data_parallel_shard_degree", "2"], 4),
        ([*IB, "--training.tensor_parallel_degree", "2"], 4),
    ):
        run_preflight(JobConfig.parse_args(["--job.config_file", "train_configs/debug_model.toml", *args]), world)


_ROOT = __file__.rsplit("/tests/", 1)[0]


def test_the_planner_leaves_gradients_out_of_its_lower_bound(monkeypatch):
    """The planner's params + grads + state bound: 4 + 4 + 8 bytes per parameter, 4 + 8 in backward."""
    from torchtitan.build import build_model_args
    from torchtitan.estimation.plan import Layout, lower_bound_bytes
    from torchtitan.spec import get_model_spec

    monkeypatch.chdir(_ROOT)
    regular = JobConfig.parse_args(["--job.config_file", "train_configs/debug_model.toml"])
    in_backward = JobConfig.parse_args(["--job.config_file", "train_configs/debug_model.toml", *IB])
    args = build_model_args(regular, get_model_spec("llama3"), 2304)
    layout = Layout(**{f.name: 1 for f in dataclasses.fields(Layout)} | {"ac": "none"})
    assert lower_bound_bytes(args, layout, in_backward) * 16 == lower_bound_bytes(args, layout, regular) * 12
