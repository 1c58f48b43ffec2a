"""LoRA's module, transform, TP styles and pre-launch refusals (single process; runs: tests/runs/features/test_lora_runs.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.support.lora import tiny_config, tiny_model
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig
from torchtitan.features.lora.linear import LoRALinear
from torchtitan.features.lora.names import resolve_targets
from torchtitan.preflight import run_preflight
from torchtitan.spec import get_model_spec


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_step_zero_logits_equal_the_base_exactly(family: str):
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    base = tiny_model("--model.name", family)
    lora = tiny_model("--model.name", family, "--lora.enable", "--lora.rank", "4")
    assert isinstance(lora.layers["0"].attention.wq, LoRALinear)
    assert torch.equal(base(tokens), lora(tokens))  # B = 0: the update is exactly 0
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_a." in n or ".lora_b." in n for n in trainable)
    assert {n for n, _ in base.named_parameters()} < {n for n, _ in lora.named_parameters()}  # base keys unchanged


def test_peft_default_init_and_the_update():
    torch.manual_seed(0)
    layer = LoRALinear(32, 48, rank=4, alpha=8.0, bias=True)
    layer.init_adapter()
    bound = 1 / math.sqrt(32)  # kaiming_uniform_(a=sqrt(5)) on fan_in 32, as nn.Linear's (and PEFT's) A
    assert layer.lora_a.weight.abs().max() <= bound and layer.lora_a.weight.abs().max() > 0.8 * bound
    assert torch.count_nonzero(layer.lora_b.weight) == 0
    nn.init.normal_(layer.lora_b.weight)
    x = torch.randn(3, 32)
    want = x @ layer.weight.T + layer.bias + 2.0 * (x @ layer.lora_a.weight.T @ layer.lora_b.weight.T)
    torch.testing.assert_close(layer(x), want)
    torch.testing.assert_close(x @ layer.merged_weight().T + layer.bias, want)


def test_peft_names_map_onto_ours():
    spec = get_model_spec("qwen3")
    got = resolve_targets(spec, ["q_proj", "w2", "gate_proj", "wq"])
    assert [(t.name, t.paths, t.peft) for t in got] == [
        ("wq", ("attention.wq",), "q_proj"),
        ("w1", ("feed_forward.w1",), "gate_proj"),
        ("w2", ("feed_forward.w2",), "down_proj"),
    ]


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        (["--lora.target_modules", "wq,qkv"], ConfigError, r"has no linear named 'qkv'; valid names .* wq/q_proj"),
        (["--lora.rank", "0"], ConfigError, r"lora.rank"),
        (["--lora.rank", "65"], ConfigError, r"lora.rank = 65 is larger than the smallest dim \(64\)"),
        (["--lora.dropout", "1.0"], ConfigError, r"lora.dropout = 1.0"),
        (["--model.name", "gpt_oss"], NotImplementedError, r"model.name = 'gpt_oss': not built.*LoRA runs on llama3"),
        (["--float8.enable_float8_linear"], NotImplementedError, r"lora.enable with float8.enable_float8_linear"),
        (["--training.compile"], NotImplementedError, r"lora.enable with training.compile"),
        (["--fault_tolerance.enable"], NotImplementedError, r"lora.enable with fault_tolerance.enable: not built"),
    ],
)
def test_bad_lora_config_is_one_line(extra: list[str], error: type, match: str):
    with pytest.raises(error, match=match) as e:
        run_preflight(tiny_config("--lora.enable", *extra), 1, this_machine=False)
    assert "\n" not in str(e.value)


def test_lora_under_tp_with_dropout_is_refused():
    config = tiny_config(
        "--lora.enable", "--lora.dropout", "0.1", "--training.tensor_parallel_degree", "2", world_size=2
    )
    with pytest.raises(NotImplementedError, match="lora.dropout > 0 under tensor parallel"):
        run_preflight(config, 2, this_machine=False)


def test_planner_floor_counts_gradients_and_adamw_state_for_the_adapters_only():
    """estimation.py --plan's lower bound for Llama 3 8B on one rank: full = 16 bytes per parameter; LoRA (rank 16,
    every linear) = the base's 4 + 12 per adapter parameter, so its floor alone (~30 GiB) rules out 24 GiB."""
    from torchtitan.estimation.plan import Layout, lower_bound_bytes
    from torchtitan.features.lora.estimate import adapter_param_count
    from torchtitan.spec import flavor_args

    full = JobConfig.parse_args(["--job.config_file", "./train_configs/llama3_8b.toml"])
    lora = JobConfig.parse_args(
        ["--job.config_file", "./train_configs/llama3_8b.toml", "--lora.enable", "--lora.rank", "16"]
    )
    args, layout = flavor_args(full.model), Layout(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1)
    params = 8_030_261_248
    adapters = adapter_param_count(lora, args.n_layers)
    assert adapters == 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))  # q o, k v, ffn
    assert lower_bound_bytes(args, layout, full) == params * 16
    assert lower_bound_bytes(args, layout, lora) == params * 4 + adapters * 12
    assert lower_bound_bytes(args, layout, lora) > 24 * 2**30 > 0.5 * lower_bound_bytes(args, layout, lora)


def test_adapter_init_does_not_depend_on_activation_checkpointing():
    """The adapters are drawn from the seed and their layer's name; AC's wrapper adds a part to the FQN."""
    plain = tiny_model("--lora.enable", "--activation_checkpoint.mode", "none").state_dict()
    wrapped = tiny_model("--lora.enable", "--activation_checkpoint.mode", "full").state_dict()
    wrapped = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in wrapped.items()}
    adapters = [k for k in plain if ".lora_a." in k]
    assert adapters and all(torch.equal(plain[k], wrapped[k]) for k in adapters)
