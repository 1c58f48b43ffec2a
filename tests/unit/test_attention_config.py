"""Pre-launch checks of the attention keys (torchtitan/features/documents/checks.py) and the MFU of
block_causal (attention FLOPs of the visible pairs only, labelled)."""

from __future__ import annotations

import os

import pytest
import torch

import torchtitan.spec as spec_module
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig
from torchtitan.observability.console import format_step_line
from torchtitan.observability.metrics import compute_num_flops_per_token
from torchtitan.preflight import run_preflight
from torchtitan.spec import ModelSpec, get_model_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = ["--model.attn_mask_type", "block_causal"]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


def _validate(args: list[str], world_size: int = 1, check_paths: bool = False) -> list[str]:
    config = JobConfig.parse_args(["--job.config_file", "train_configs/debug_model.toml", *args])
    return run_preflight(config, world_size, this_machine=check_paths)


def test_block_causal_runs_on_every_layout_it_supports():
    assert _validate(BLOCK) == []
    assert _validate([*BLOCK, "--model.positions_per_document"]) == []
    cp2 = [*BLOCK, "--experimental.context_parallel_degree", "2"]
    assert _validate(cp2, world_size=2) == []
    assert _validate([*BLOCK, "--model.name", "llama3_moe", "--experimental.expert_parallel_degree", "2"], 2) == []


def test_refusals_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match="positions_per_document.*attn_mask_type = 'block_causal'"):
        _validate(["--model.positions_per_document"])
    torch_cp = [*BLOCK, "--experimental.context_parallel_degree", "2", "--experimental.context_parallel_impl", "torch"]
    with pytest.raises(NotImplementedError, match="context_parallel_impl = 'portable'"):
        _validate(torch_cp, world_size=2)
    if not torch.cuda.is_available():
        with pytest.raises(NotImplementedError, match="'flex' needs CUDA"):
            _validate([*BLOCK, "--model.attention_backend", "flex"], check_paths=True)
    # the estimator plans for another machine: flex is not refused for lack of CUDA here
    assert _validate([*BLOCK, "--model.attention_backend", "flex"]) == []


def test_family_without_documents_is_refused(monkeypatch):
    llama = get_model_spec("llama3")
    # registered for this test only (model_names() is read elsewhere)
    monkeypatch.setitem(
        spec_module._SPECS, "no_docs_family", ModelSpec("no_docs_family", llama.model_cls, llama.flavors)
    )
    with pytest.raises(NotImplementedError, match="no_docs_family.*take no document ids"):
        _validate([*BLOCK, "--model.name", "no_docs_family"])


def test_settings_without_effect_warn():
    (warning,) = _validate(["--model.attention_backend", "sdpa"])
    assert "no effect with model.attn_mask_type = 'causal'" in warning
    cp2 = [*BLOCK, "--model.attention_backend", "sdpa", "--experimental.context_parallel_degree", "2"]
    (warning,) = _validate(cp2, world_size=2)
    assert "ring attention" in warning


def test_mfu_counts_visible_pairs_and_says_so():
    full = compute_num_flops_per_token(1000, n_layers=2, n_heads=4, head_dim=8, seq_len=16)
    assert full == 6 * 1000 + 12 * 2 * 4 * 8 * 16
    # two windows of 16 tokens holding documents of 4 and 12 tokens: (10 + 78) pairs each, 5.5 per token
    visible = compute_num_flops_per_token(1000, 2, 4, 8, 16, attention_pairs=2 * (10 + 78) / 32)
    assert visible == 6 * 1000 + 12 * 2 * 4 * 8 * 5.5
    record = {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tps": 10.0, "mfu": 1.0, "memory_gib": 0.1}
    assert "mfu " in format_step_line(1, 2, record, 0.0) and "visible" not in format_step_line(1, 2, record, 0.0)
    assert "mfu(visible)" in format_step_line(1, 2, {**record, "mfu_attention": "visible_pairs"}, 0.0)
