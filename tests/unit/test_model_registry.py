"""The model-family registry (torchtitan/spec.py): one line per family naming the module that holds its
spec, imported on first use. Adding a family touches only its folder and that one line: the test below
writes a family in a temporary folder and takes it through the pre-launch check and the build path.
(tests/support/tiny_family.py registers a ready ModelSpec instead and trains it: tests/distributed/test_model_family.py.)
"""

from __future__ import annotations

import ast
import os
import sys
import textwrap

import pytest
import torch

import torchtitan.spec as spec_module
from torchtitan.build import build_meta_model, build_model_args
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig
from torchtitan.preflight import run_preflight
from torchtitan.spec import (
    ModelSpec,
    flavor_args,
    get_model_spec,
    model_names,
    register_model_family,
    register_model_spec,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A family's whole folder: pure modules and flavors, and spec.py (its ModelSpec and its own check).
TOY_FAMILY = {
    "__init__.py": """
        from toy_family.model import ToyTransformer
        from torchtitan.models.llama import ModelArgs

        toy_configs = {"tiny": ModelArgs(dim=32, n_layers=2, n_heads=2, multiple_of=16, max_seq_len=256)}
        """,
    "model.py": """
        from torchtitan.models.llama import Transformer


        class ToyTransformer(Transformer):
            '''Llama's layout under another name: the default parallelize and pipeline split apply.'''
        """,
    "spec.py": """
        from torchtitan.config.errors import ConfigError
        from torchtitan.spec import ModelSpec
        from toy_family import ToyTransformer, toy_configs


        def check_toy_config(args, *, model, training, experimental):
            if training.tensor_parallel_degree > 1:
                raise NotImplementedError(f"model.name = {model.name!r} is not tensor-parallel; set tp to 1")
            if experimental.pipeline_parallel_degree > args.n_layers:
                raise ConfigError("toy: fewer layers than pipeline stages")
            return [f"model {model.flavor}: a toy at training.seq_len = {training.seq_len}"]


        SPEC = ModelSpec("toy", ToyTransformer, toy_configs, documents=True, check_fn=check_toy_config)
        """,
}


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is, restored after the test (registrations are process-wide)."""
    monkeypatch.setattr(spec_module, "_FAMILIES", dict(spec_module._FAMILIES))
    monkeypatch.setattr(spec_module, "_SPECS", dict(spec_module._SPECS))
    monkeypatch.chdir(ROOT)
    yield
    for module in [m for m in sys.modules if m.split(".")[0] in ("toy_family", "empty_family")]:
        del sys.modules[module]


def _config(*args: str) -> JobConfig:
    return JobConfig.parse_args(["--job.config_file", "train_configs/debug_model.toml", *args])


def test_a_family_is_its_folder_and_one_registry_line(tmp_path, monkeypatch, registry):
    for name, text in TOY_FAMILY.items():
        (tmp_path / "toy_family").mkdir(exist_ok=True)
        (tmp_path / "toy_family" / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))

    register_model_family("toy", "toy_family.spec")  # the one line

    assert "toy" in model_names() and "toy_family.spec" not in sys.modules  # listed, not yet imported
    toy = ["--model.name", "toy", "--model.flavor", "tiny"]
    config = _config(*toy)
    warnings = run_preflight(config, 1, this_machine=False)  # the generic checks and the family's
    assert "toy_family.spec" in sys.modules and "model tiny: a toy at training.seq_len = 256" in warnings
    spec = get_model_spec("toy")
    assert flavor_args(config.model) is spec.flavors["tiny"]
    with pytest.raises(NotImplementedError, match="model.name = 'toy' is not tensor-parallel"):
        run_preflight(_config(*toy, "--training.tensor_parallel_degree", "2"), 2, this_machine=False)
    sections = dict(model=config.model, training=config.training, experimental=config.experimental)
    assert spec.check_fn(spec.flavors["tiny"], **sections) == ["model tiny: a toy at training.seq_len = 256"]

    args = build_model_args(config, spec, vocab_size=64, device_type="cpu")
    assert type(build_meta_model(spec, args)).__name__ == "ToyTransformer"
    logits = spec.model_cls(args)(torch.randint(0, 64, (2, 16)))
    assert logits.shape == (2, 16, 64)  # (bs, seqlen, vocab)


def test_in_tree_families_live_in_their_folders():
    for name, module in spec_module._FAMILIES.items():
        assert module.startswith("torchtitan.models.") and module.endswith(".spec"), (name, module)
        spec = get_model_spec(name)
        assert spec.name == name and spec.check_fn is not None
        assert spec.model_cls.__module__.startswith(module.rpartition(".")[0]), (name, spec.model_cls)
    # llama3/qwen3 share the dense check, llama3_moe/qwen3_moe the MoE check: each defined once
    assert get_model_spec("qwen3").check_fn is get_model_spec("llama3").check_fn
    assert get_model_spec("qwen3_moe").check_fn is get_model_spec("llama3_moe").check_fn


def test_registry_imports_no_family():
    """spec.py names the family modules as data: importing it (or listing names) imports none of them."""
    tree = ast.parse(open(spec_module.__file__, encoding="utf-8").read())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("torchtitan.models")]


def test_registration_errors_name_the_family(tmp_path, monkeypatch, registry):
    llama = get_model_spec("llama3")
    with pytest.raises(ValueError, match="'llama3' is already registered"):
        register_model_spec(ModelSpec("llama3", llama.model_cls, llama.flavors))
    with pytest.raises(ValueError, match="'qwen3' is already registered"):
        register_model_family("qwen3", "somewhere.else.spec")
    register_model_spec(llama)  # the same spec again: a no-op
    (tmp_path / "empty_family.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_model_family("empty", "empty_family")
    with pytest.raises(ValueError, match="empty_family, which defines no ModelSpec named 'empty'"):
        get_model_spec("empty")
    with pytest.raises(ConfigError, match="model.flavor = 'huge' is not a llama3 flavor; allowed are"):
        flavor_args(_config("--model.flavor", "huge").model)
    with pytest.raises(ConfigError, match="model.name = 'nope' is unknown; registered families: .*'empty'"):
        run_preflight(_config("--model.name", "nope"), 1, this_machine=False)
