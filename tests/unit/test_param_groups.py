"""Parameter groups (components/optim/param_groups.py): the no_decay preset and Muon's default rule set over each
family's canonical names, the rules' one-line errors, and a run against hand-built torch optimizers."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.components.optim.lr_schedule import lr_factor_fn
from torchtitan.components.optim.optimizer import build_lr_scheduler, build_optimizer
from torchtitan.components.optim.param_groups import (
    assign_groups,
    canonical_name,
    check_param_groups,
    format_group_table,
    optimizer_state_by_group,
)
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig
from torchtitan.config.schema import Optimizer as OptimizerConfig
from torchtitan.config.schema import Training
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.spec import get_model_spec

FAMILIES = ("llama3", "qwen3", "deepseek_v3", "gpt_oss")


def _meta_model(family: str) -> nn.Module:
    spec = get_model_spec(family)
    with torch.device("meta"):
        return spec.model_cls(spec.flavors["debugmodel_tiny"])


def _by_module_kind(model: nn.Module) -> tuple[set[str], set[str]]:
    """An oracle independent of the preset's regexes: (norms, biases and embeddings) by module class, and the
    hidden matrices (2-D weights of Linear layers inside the blocks, not routers; stacked expert weights)."""
    no_decay, hidden = set(), set()
    for mod_name, mod in model.named_modules():
        for leaf, p in mod.named_parameters(recurse=False):
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            kind = type(mod).__name__
            if "Norm" in kind or isinstance(mod, nn.Embedding) or leaf == "bias" or re.fullmatch(r"b\d", leaf):
                no_decay.add(name)
            elif mod_name.startswith("layers.") and "router" not in mod_name and p.ndim in (2, 3) and leaf != "sinks":
                hidden.add(name)
    return no_decay, hidden


@pytest.mark.parametrize("family", FAMILIES)
def test_no_decay_preset_is_exactly_the_norms_biases_and_embeddings(family):
    model = _meta_model(family)
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    groups = assign_groups(named, OptimizerConfig(no_decay=["norm", "bias", "embedding"]))
    got = {n for g in groups if g.settings["weight_decay"] == 0.0 for n in g.names}
    want, _ = _by_module_kind(model)
    assert got == want
    assert sum(len(g.names) for g in groups) == len(named)
    assert [g.settings["weight_decay"] for g in groups] == [0.1, 0.0]


@pytest.mark.parametrize("family", FAMILIES)
def test_muon_default_rule_set_takes_the_hidden_matrices(family):
    model = _meta_model(family)
    groups = assign_groups([(n, tuple(p.shape)) for n, p in model.named_parameters()], OptimizerConfig(name="Muon"))
    assert [g.optimizer for g in groups] == ["AdamW", "Muon"]
    _, hidden = _by_module_kind(model)
    assert set(groups[1].names) == hidden
    assert groups[1].settings["lr"] == OptimizerConfig().lr and groups[1].settings["momentum"] == 0.95


def test_canonical_names_drop_the_wrappers():
    assert canonical_name("layers.0._checkpoint_wrapped_module.attention.wq.weight") == "layers.0.attention.wq.weight"
    assert canonical_name("layers.1._orig_mod.ffn_norm.weight") == "layers.1.ffn_norm.weight"


def test_rules_first_match_wins_and_multiplier_scales_the_schedule():
    cfg = OptimizerConfig(
        lr=1e-3,
        no_decay=["norm"],
        param_groups=[
            {"pattern": r"^tok_embeddings\.", "lr_multiplier": 0.5, "betas": [0.8, 0.9]},
            {"pattern": "norm", "weight_decay": 0.3},
            {"pattern": ".*", "weight_decay": 0.05},
        ],
    )
    model = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32, max_seq_len=8))
    opt = build_optimizer([model], cfg)
    settings = [(g["lr"], g["weight_decay"], g["betas"], len(g["params"])) for g in opt.param_groups]
    assert settings == [(5e-4, 0.1, (0.8, 0.9), 1), (1e-3, 0.0, (0.9, 0.95), 3), (1e-3, 0.05, (0.9, 0.95), 8)]
    sched = build_lr_scheduler(opt, Training(warmup_steps=4, steps=10))
    factor = lr_factor_fn(Training(warmup_steps=4, steps=10))(0)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4 * factor, 1e-3 * factor, 1e-3 * factor])
    del sched
    table = format_group_table(assign_groups([(n, tuple(p.shape)) for n, p in model.named_parameters()], cfg))
    assert "optimizer.param_groups[0] (pattern '^tok_embeddings\\\\.')" in table and "lr=0.0005" in table


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--optimizer.param_groups", '[{pattern = "nrm"}, {pattern = ".*"}]'], "[0] (pattern 'nrm') matches no param"),
        (["--optimizer.param_groups", '[{pattern = "attention"}]'], "match no rule, e.g. ['tok_embeddings.weight'"),
        (
            ["--optimizer.param_groups", '[{pattern = "norm", optimizer = "Muon"}, {pattern = ".*"}]'],
            "gives Muon to layers.0.attention_norm.weight of shape [64]: Muon updates matrices only",
        ),
        (["--optimizer.param_groups", '[{pattern = ".*", optimizer = "SGD"}]'], "optimizer = 'SGD' is unknown"),
        (["--optimizer.param_groups", '[{pattern = ".*", momentum = 0.9}]'], "unknown keyword 'momentum' for optim"),
        (["--optimizer.param_groups", '[{pattern = "("}]'], "pattern '(' is not a regex"),
        (["--optimizer.no_decay", "norm,biases"], "'biases' is not a kind; allowed are ['norm', 'bias', 'embed"),
    ],
    ids=["matches-nothing", "no-catch-all", "muon-1d", "unknown-optimizer", "unknown-keyword", "bad-regex", "word"],
)
def test_bad_rules_are_one_line_before_launch(flags, message):
    config = JobConfig.parse_args(["--model.flavor", "debugmodel_tiny", *flags])
    with pytest.raises(ConfigError) as e:
        check_param_groups(config, None)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_in_backward_refuses_muon_in_one_line():
    from torchtitan.features.in_backward.checks import check_in_backward

    config = JobConfig.parse_args(
        ["--optimizer.name", "Muon", "--optimizer.early_step_in_backward", "--training.max_norm", "0"]
    )
    with pytest.raises(NotImplementedError, match="with Muon") as e:
        check_in_backward(config, None)
    assert "\n" not in str(e.value)


def test_no_decay_run_equals_two_group_torch_adamw():
    """Five steps of the tiny llama with the preset, warmup and clipping, against a hand-built two-group
    torch.optim.AdamW and LambdaLR over a copy of the same model: losses and weights step for step."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16))
    ref = copy.deepcopy(model)
    train = Training(warmup_steps=2, steps=5)
    opt = build_optimizer([model], OptimizerConfig(lr=3e-3, no_decay=["norm", "bias", "embedding"]))
    sched = build_lr_scheduler(opt, train)
    no_decay = [p for n, p in ref.named_parameters() if "norm" in n or "embeddings" in n]
    decay = [p for n, p in ref.named_parameters() if not ("norm" in n or "embeddings" in n)]
    ref_opt = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1
    )
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lr_factor_fn(train))
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        tokens = torch.randint(0, 64, (4, 17), generator=g)
        losses = []
        for m, o, s in ((model, opt, sched), (ref, ref_opt, ref_sched)):
            loss = F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
            s.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=0, msg=n)


def test_estimator_counts_state_per_group():
    """AdamW keeps 2 moments per parameter, Muon 1: the report's groups and the planner's lower bound."""
    from torchtitan.estimation.plan import Layout, lower_bound_bytes

    model = _meta_model("llama3")
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    muon_rows = optimizer_state_by_group(named, OptimizerConfig(name="Muon"))
    hidden = sum(math.prod(s) for n, s in named if n.startswith("layers.") and len(s) == 2)
    total = sum(math.prod(s) for _, s in named)
    assert [(r["optimizer"], r["params"], r["states_per_param"]) for r in muon_rows] == [
        ("AdamW", total - hidden, 2),
        ("Muon", hidden, 1),
    ]
    assert sum(r["state_bytes"] for r in muon_rows) == 4 * (2 * (total - hidden) + hidden)
    config = JobConfig.parse_args(["--model.flavor", "debugmodel_tiny"])
    args = get_model_spec("llama3").flavors["debugmodel_tiny"]
    layout = Layout(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1)
    adamw = lower_bound_bytes(args, layout, config)
    config.optimizer.name = "Muon"
    assert adamw - lower_bound_bytes(args, layout, config) == 4 * hidden // 2  # one fp32 state fewer, sharded over 2


def test_toml_array_of_tables_and_the_dumped_config_round_trip(tmp_path):
    path = tmp_path / "groups.toml"
    path.write_text(
        '[optimizer]\nno_decay = ["norm", "embedding"]\n'
        '[[optimizer.param_groups]]\npattern = "^tok_embeddings\\\\."\nlr_multiplier = 0.5\nbetas = [0.8, 0.9]\n'
        '[[optimizer.param_groups]]\npattern = ".*"\n'
    )
    config = JobConfig.parse_args(["--job.config_file", str(path)])
    assert config.optimizer.param_groups == [
        {"pattern": r"^tok_embeddings\.", "lr_multiplier": 0.5, "betas": [0.8, 0.9]},
        {"pattern": ".*"},
    ]
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(config.to_toml())  # what a run writes into its dump folder
    again = JobConfig.parse_args(["--job.config_file", str(dumped)])
    assert again.optimizer.param_groups == config.optimizer.param_groups
    assert again.optimizer.no_decay == ["norm", "embedding"]
    cli = JobConfig.parse_args(["--optimizer.param_groups", r'[{pattern = "^tok_embeddings\\.", lr = 1e-3}]'])
    assert cli.optimizer.param_groups == [{"pattern": r"^tok_embeddings\.", "lr": 1e-3}]
    with pytest.raises(ConfigError, match="optimizer.param_groups': got 'norm'"):
        JobConfig.parse_args(["--optimizer.param_groups", "norm"])
