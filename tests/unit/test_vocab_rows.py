"""One rule for the model's embedding rows, every family (checkpointing/hf/files.py ``vocab_rows``), checked before
launch: the ``vocab_size`` of the model config a run names (the HF folder it starts from, ``model.hf_config``) is
kept, padded past the tokenizer's words or equal to them; fewer rows than the tokenizer's words is refused by
``python -m torchtitan.preflight`` in one line naming both sizes and the fix (the model is never resized to its
tokenizer); a flavor names no vocabulary and takes the tokenizer's words. The shipped tokenizer has 2,304 words.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torchtitan.preflight.__main__ import main

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
WORDS = 2304  # the shipped pydocs_bpe2048.tiktoken's, special tokens included
HF_DEBUG = ["--job.config_file", "train_configs/hf_debug.toml"]


def _folder(path: Path, vocab_size: int | None, model_type: str = "llama") -> str:
    """An HF folder: a tiny config.json (``vocab_size`` set, or not) and a safetensors file (its header is read)."""
    from torchtitan.models.hf.spec import TINY

    path.mkdir()
    config = {k: v for k, v in TINY["llama_tiny"].items() if k != "vocab_size"}
    config["model_type"] = model_type
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    (path / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(64)}, str(path / "model.safetensors"))
    return str(path)


def _preflight(capsys, monkeypatch, tmp_path, *args: str) -> tuple[int, str, str]:
    monkeypatch.chdir(ROOT)
    code = main(["--world_size", "2", *args, "--job.dump_folder", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("family", "start"),
    [(HF_DEBUG + ["--model.flavor", "config"], False), (HF_DEBUG + ["--model.flavor", "config"], True), ([], True)],
    ids=["hf_config", "hf_config_and_initial_load_in_hf", "llama3_initial_load_in_hf"],
)
def test_a_model_config_smaller_than_the_tokenizer_is_refused_before_launch(
    family, start, tmp_path, capsys, monkeypatch
):
    folder = _folder(tmp_path / "v2048", 2048)
    args = [*family, *(["--model.hf_config", folder] if "config" in family else [])]
    args += ["--checkpoint.initial_load_path", folder, "--checkpoint.initial_load_in_hf"] if start else []
    code, out, err = _preflight(capsys, monkeypatch, tmp_path, *args)
    where = f"Hugging Face folder '{folder}' has" if start else f"model.hf_config = '{folder}' sets"
    assert (code, out) == (2, ""), out
    assert err.startswith(f"error: {where} vocab_size 2048, fewer rows than the tokenizer's {WORDS} words"), err
    assert "the model is not resized to its tokenizer" in err and err.count("\n") == 1, err


def test_a_named_vocabulary_is_kept_and_a_flavor_takes_the_tokenizers(tmp_path, capsys, monkeypatch):
    """A config padded past the tokenizer passes the check and builds its own rows; a config that sets no
    ``vocab_size`` (transformers would default it) and a tiny flavor of ours build the tokenizer's words."""
    from torchtitan.build import build_model_args
    from torchtitan.config.manager import JobConfig
    from torchtitan.spec import get_model_spec

    padded = _folder(tmp_path / "v2432", 2432)
    code, out, err = _preflight(
        capsys, monkeypatch, tmp_path, *HF_DEBUG, "--model.flavor", "config", "--model.hf_config", padded
    )
    assert code == 0 and out.startswith("ok: train_configs/hf_debug.toml, world_size 2"), err
    unset = _folder(tmp_path / "unset", None)
    for model, rows in (
        (["--model.flavor", "config", "--model.hf_config", padded], 2432),
        (["--model.flavor", "config", "--model.hf_config", unset], WORDS),
        (["--model.flavor", "llama_tiny"], WORDS),  # its transformers config says 2048: a flavor names no vocabulary
    ):
        config = JobConfig.parse_args([*HF_DEBUG, *model])
        assert build_model_args(config, get_model_spec("hf"), WORDS, device_type="cpu").vocab_size == rows, model
