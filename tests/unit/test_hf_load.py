"""Starting a run from a Hugging Face folder (checkpoint.initial_load_in_hf) and writing one
(checkpoint.last_save_in_hf): the one-process parts. The sharded multi-rank load and the round trip
through transformers are tests/runs/checkpoint/test_hf_finetune.py.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from torchtitan.build import build_model_args
from torchtitan.checkpointing.hf.convert import check_hf_matches, save_hf_folder
from torchtitan.checkpointing.hf.files import hf_weight_files
from torchtitan.checkpointing.hf.run import load_hf_into
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig
from torchtitan.models.llama.hf_adapter import ADAPTER as hf_adapter
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.preflight import run_preflight
from torchtitan.spec import get_model_spec

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64)


def _model(seed: int, args: ModelArgs = ARGS) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


def _hf_folder(folder: str, model: Transformer, max_shard_bytes: int) -> dict:
    args = dataclasses.asdict(model.args)
    sd = model.state_dict()
    config = hf_adapter.hf_config(args, sd, torch.float32)
    save_hf_folder(hf_adapter.to_hf_state_dict(sd, args), config, folder, max_shard_bytes=max_shard_bytes)
    return config


@pytest.mark.parametrize("shard_bytes", [10**9, 40_000], ids=["one-file", "sharded"])
def test_load_replaces_every_weight_exactly(tmp_path, shard_bytes):
    source, target = _model(1), _model(2)
    _hf_folder(str(tmp_path), source, shard_bytes)
    files = set(hf_weight_files(str(tmp_path)).values())
    assert (len(files) > 1) == (shard_bytes < 10**9)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == (len(files) > 1)
    load_hf_into(target, str(tmp_path), "llama3", dataclasses.asdict(ARGS))
    for key, w in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], w), key


def test_tied_model_loads_one_table(tmp_path):
    args = dataclasses.replace(ARGS, tie_word_embeddings=True)
    source, target = _model(1, args), _model(2, args)
    _hf_folder(str(tmp_path), source, 40_000)
    load_hf_into(target, str(tmp_path), "llama3", dataclasses.asdict(args))
    assert target.output.weight is target.tok_embeddings.weight
    assert torch.equal(target.tok_embeddings.weight, source.tok_embeddings.weight)


def test_flavor_and_family_mismatches_are_named(tmp_path):
    _hf_folder(str(tmp_path), _model(1), 10**9)
    other = dataclasses.asdict(dataclasses.replace(ARGS, n_layers=3, n_kv_heads=None))
    with pytest.raises(
        ValueError, match=r"does not match model.flavor \(n_kv_heads: flavor None vs checkpoint 2, n_layers"
    ):
        check_hf_matches(str(tmp_path), "llama3", other)
    with pytest.raises(ValueError, match="holds a 'llama' model and model.name = 'qwen3' reads 'qwen3'"):
        check_hf_matches(str(tmp_path), "qwen3", dataclasses.asdict(ARGS))
    # the run's seq_len and norm kernel size no weight: not a mismatch
    check_hf_matches(str(tmp_path), "llama3", dataclasses.asdict(dataclasses.replace(ARGS, max_seq_len=8)))


def test_missing_weight_and_bad_shape_are_named(tmp_path):
    _hf_folder(str(tmp_path), _model(1, dataclasses.replace(ARGS, n_layers=1)), 10**9)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 2  # the folder claims two layers and holds one
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"lacks weights of this model: layers\.1\."):
        load_hf_into(_model(2), str(tmp_path), "llama3", dataclasses.asdict(ARGS))
    wide = dataclasses.replace(ARGS, multiple_of=512)  # another FFN width: config.json does not say it
    with pytest.raises(
        ValueError, match=r"weight layers\.0\.feed_forward\.w[123]\.weight has shape \((256, 64|64, 256)\), the model's"
    ):
        load_hf_into(_model(2, wide), str(tmp_path), "llama3", dataclasses.asdict(wide))


def test_no_config_no_safetensors(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        check_hf_matches(str(tmp_path), "llama3", dataclasses.asdict(ARGS))
    with pytest.raises(ValueError, match=r"no \*\.safetensors files; re-save the model"):
        hf_weight_files(str(tmp_path))


def test_vocab_rows_come_from_the_hf_model(tmp_path):
    """Published models pad the table past the tokenizer (the loss sees the padding rows, as HF's)."""
    spec = get_model_spec("llama3")
    _hf_folder(str(tmp_path), _model(1, dataclasses.replace(ARGS, vocab_size=300)), 10**9)
    config = JobConfig.parse_args(["--checkpoint.initial_load_path", str(tmp_path), "--checkpoint.initial_load_in_hf"])
    assert build_model_args(config, spec, 256).vocab_size == 300
    with pytest.raises(ValueError, match="vocab_size 300, fewer rows than the tokenizer's 512 words"):
        build_model_args(config, spec, 512)


@pytest.mark.parametrize(
    "args, error",
    [
        (
            ["--checkpoint.initial_load_in_hf"],
            "checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path",
        ),
        (["--checkpoint.last_save_in_hf"], "checkpoint.last_save_in_hf = true converts the last step's checkpoint"),
        (
            ["--checkpoint.initial_load_path", "{tmp}"],
            "it looks like a Hugging Face folder: set checkpoint.initial_load_in_hf",
        ),
    ],
    ids=["in-hf-without-path", "last-save-without-checkpoint", "hf-folder-as-dcp"],
)
def test_config_checks(tmp_path, args, error):
    _hf_folder(str(tmp_path), _model(1), 10**9)
    config = JobConfig.parse_args([a.format(tmp=tmp_path) for a in args])
    with pytest.raises((ConfigError, ValueError), match=error):
        run_preflight(config, 1)
