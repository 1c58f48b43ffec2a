"""Upstream torchtitan 2026's recipes (``--module torchtitan_recipes.tests.features --config F``) read here.

tests/assets/torchtitan_2026/ holds upstream's recipe package and its suite list (pytorch/torchtitan b5bcd76c6),
unchanged. Each enabled configuration of the suite loads onto our keys or is refused in one line naming the field;
the field table (config/compat/keys_2026.py) covers every field and is the docs' table. Training them is
scripts/upstream_2026_suite.py (a sample in tests/runs/launch/test_upstream_2026_runs.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from tests.support.scripts import script_module
from torchtitan.config.compat.keys_2026 import RULES, markdown_table
from torchtitan.config.compat.upstream_2026 import classes as c
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig, format_help

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSETS = os.path.join(ROOT, "tests", "assets", "torchtitan_2026")
MODULE = "torchtitan_recipes.tests.features"
suite = script_module("upstream_2026_suite")
with open(os.path.join(ASSETS, "integration_tests", "features.py")) as _f:
    ENABLED = [(cfg, e.ngpu) for e in suite.read_suite(_f.read()) if not e.disabled for cfg in e.configs]
# The enabled configurations refused here, each by the one line naming its field (docs/compatibility.md's table).
REFUSED = {
    "llama3_debugmodel_float8_emulate_lora_tp2_pp2": "Trainer.Config.model_spec.converters[Float8LinearConverter]"
    ".emulate = True: emulated float8 GEMMs are not built",
}


@pytest.fixture
def recipes(monkeypatch):
    monkeypatch.chdir(ASSETS)  # --module's dotted name is imported from the current directory


def parse(config: str, world_size: int, *flags: str) -> JobConfig:
    return JobConfig.parse_args(["--module", MODULE, "--config", config, *flags], world_size=world_size)


def _leaf_paths() -> set[str]:
    paths = set()
    for f in dataclasses.fields(c.TrainerConfig):
        section = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(section) and f.name not in ("dataloader", "loss", "activation_checkpoint"):
            paths |= {f"{f.name}.{g.name}" for g in dataclasses.fields(section)}
        else:
            paths.add(f.name)
    for cls in (c.SelectiveACConfig, c.MemoryBudgetACConfig):
        paths |= {f"activation_checkpoint.{g.name}" for g in dataclasses.fields(cls)}
    return paths


def test_every_field_of_upstreams_trainer_config_has_one_rule():
    assert _leaf_paths() == set(RULES)


def test_docs_and_help_are_the_rule_table():
    with open(os.path.join(ROOT, "docs", "compatibility.md")) as f:
        assert markdown_table() in f.read()
    text = format_help()
    assert all(f"Trainer.Config.{path}: " in text for path in RULES)


def test_the_suite_has_41_enabled_configurations():
    assert len(ENABLED) == 41


@pytest.mark.parametrize("config, world_size", ENABLED, ids=[c for c, _ in ENABLED])
def test_each_enabled_configuration_loads_or_is_refused_in_one_line(config, world_size, recipes):
    if config in REFUSED:
        with pytest.raises(NotImplementedError) as e:
            parse(config, world_size)
        assert str(e.value) == f"{config}() of {MODULE}: {REFUSED[config]} (float8 here needs torchao and a device " \
            "that runs torch._scaled_mm)"  # fmt: skip
        return
    job = parse(config, world_size)
    assert (job.model.attn_mask_type, job.model.positions_per_document) == ("block_causal", True)
    assert (job.training.seq_len, job.training.lr_schedule, job.optimizer.lr) == (2048, "wsd", 8e-4)


def test_values_read_from_upstreams_fields(recipes):
    tp2 = parse("llama3_debugmodel_tp2", 4)
    t, o = tp2.training, tp2.optimizer
    assert (t.tensor_parallel_degree, t.batch_size, t.steps, t.loss_chunk_size, t.warmup_steps) == (2, 8, 10, 256, 2)
    assert (t.lr_decay_ratio, t.lr_decay_type, t.lr_min_factor, tp2.metrics.log_freq) == (0.8, "linear", 0.0, 1)
    assert (o.name, o.beta1, o.beta2, o.eps, o.weight_decay, o.fused) == ("AdamW", 0.9, 0.95, 1e-8, 0.1, True)
    assert tp2.activation_checkpoint.mode == "none"  # _use_spmd_types(typechecking=True) sets it to None
    assert (tp2.training.dataset, tp2.model.tokenizer_path) == ("c4_test", "./tests/assets/tokenizer")
    pp = parse("llama3_debugmodel_fsdp2_pp2_1f1b", 4).experimental
    assert (pp.pipeline_parallel_degree, pp.pipeline_parallel_microbatches, pp.pipeline_parallel_schedule) == (
        2,
        8,
        "1F1B",
    )
    assert parse("llama3_debugmodel_fsdp2_pp2_1f1b", 4).training.loss_chunk_size == 0  # the pipeline's: full logits
    assert parse("llama3_debugmodel_sft", 2).validation.enabled is False  # upstream's validator (steps = -1) is off
    accumulation = parse("llama3_debugmodel_gradient_accumulation", 2).training  # 65536 / (16384 x dp 2)
    assert (accumulation.batch_size, accumulation.gradient_accumulation_steps) == (8, 2)
    bf16 = parse("llama3_debugmodel_optimizer_bf16_states", 2).optimizer
    assert (bf16.fused, bf16.state_dtype) == (False, "bfloat16")  # torch's fused kernel: states in the param dtype
    compiled = parse("llama3_debugmodel_compile_sac_op", 4)
    assert (compiled.training.compile, compiled.training.compile_loss, compiled.training.loss_chunk_size) == (
        True,
        True,
        0,
    )
    assert (compiled.activation_checkpoint.mode, compiled.activation_checkpoint.selective_ac_option) == (
        "selective",
        "op",
    )
    cp = parse("llama3_debugmodel_cp4", 4).experimental
    assert (cp.context_parallel_degree, cp.context_parallel_load_balance) == (4, True)
    dsv3 = parse("deepseek_v3_debugmodel_fused_grouped_experts_tp2_ep4", 4)
    assert (dsv3.model.name, dsv3.experimental.expert_parallel_degree) == ("deepseek_v3", 4)
    sft = parse("llama3_debugmodel_sft", 2).training
    assert (sft.dataset_format, sft.loss_on, sft.dataset_path) == (
        "chat",
        "assistant",
        "tests/assets/sft_test/data.json",
    )
    hf = parse("llama3_debugmodel_hf_checkpoint_load", 4).checkpoint
    assert (hf.enable_checkpoint, hf.initial_load_in_hf, hf.model_weights_only) == (True, True, False)


def test_speed_only_fields_warn_once(recipes, caplog):
    parse("llama3_debugmodel_tp2_no_sp", 4)
    said = [
        r.getMessage()
        for r in caplog.records
        if "Trainer.Config.parallelism.enable_sequence_parallel" in r.getMessage()
    ]
    assert len(said) == 1 and "= False: no effect here (speed only and memory" in said[0]


def test_flags_go_on_top_of_a_recipe(recipes):
    job = parse("llama3_debugmodel_tp2", 4, "--training.seq_len", "128", "--training.steps", "2")
    assert (job.training.seq_len, job.training.steps, job.training.tensor_parallel_degree) == (128, 2, 2)


def test_our_module_names_are_ours_again_after_a_recipe(recipes):
    import torchtitan.distributed.activation_checkpoint as ours

    parse("llama3_debugmodel_pp4_zero_bubble", 4)
    assert sys.modules["torchtitan.distributed.activation_checkpoint"] is ours
    assert "torchtitan.trainer" not in sys.modules


def _recipe(tmp_path, body: str) -> str:
    folder = tmp_path / "torchtitan_recipes"
    folder.mkdir()
    path = folder / "mine.py"
    path.write_text("from torchtitan.trainer import Trainer\n" + body)
    return str(path)


def test_an_unknown_upstream_field_is_one_line(tmp_path):
    path = _recipe(tmp_path, (
        "from torchtitan.models.llama3.config_registry import llama3_debugmodel\n"
        "def f() -> Trainer.Config:\n    config = llama3_debugmodel()\n    config.training.stepz = 3\n    return config\n"
    ))  # fmt: skip
    with pytest.raises(ConfigError) as e:
        JobConfig.parse_args(["--module", path, "--config", "f"])
    message = str(e.value)
    assert "\n" not in message and f"({path}, line 5)" in message
    assert "TrainingConfig has no field 'stepz' (did you mean 'steps'?): upstream torchtitan 2026's fields: " in message


def test_an_upstream_name_not_provided_is_one_line(tmp_path):
    path = _recipe(tmp_path, "from torchtitan.models.llama3.config_registry import llama3_8b\n")
    with pytest.raises(ConfigError, match=r"^--module .*: importing it raised ImportError: upstream torchtitan 2026's "
                       r"torchtitan.models.llama3.config_registry.llama3_8b is not provided here; the stand-ins of "
                       r"torchtitan.models.llama3.config_registry: llama3_debugmodel, .*\(.*mine.py, line 2\)$"):  # fmt: skip
        JobConfig.parse_args(["--module", path, "--config", "f"])


@pytest.mark.parametrize(
    "edit, error",
    [
        ("config.comm.mode = 'torchcomms'", "Trainer.Config.comm.mode = 'torchcomms': torchcomms and the fake"),
        ("config.training.num_tokens_per_microbatch_per_dp_rank = 3000",
         "Trainer.Config.training.num_tokens_per_microbatch_per_dp_rank = 3000: must be a positive multiple of "
         "max_context_length (2048)"),
        ("config.optimizer.implementation = 'for-loop'", "Trainer.Config.optimizer.implementation = 'for-loop': "
         "'for-loop' is not built"),
        ("config.override.imports = ['x.y']", "Trainer.Config.override.imports = ['x.y']: 'x.y' is not built"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(tmp_path, edit, error):
    path = _recipe(tmp_path, (
        "from torchtitan.models.llama3.config_registry import llama3_debugmodel\n"
        f"def f() -> Trainer.Config:\n    config = llama3_debugmodel()\n    {edit}\n    return config\n"
    ))  # fmt: skip
    with pytest.raises((ConfigError, NotImplementedError)) as e:
        JobConfig.parse_args(["--module", path, "--config", "f"])
    assert str(e.value).startswith(f"f() of {path}: {error}") and "\n" not in str(e.value)
