"""A user's file that does not parse is named with its line (or row, or part) in one line (config/errors.py
``parsing``): through ``python -m torchtitan.preflight`` where the pre-launch check reads the file (the TOML config,
``model.hf_config``'s config.json, an HF folder's safetensors header, the tokenizer files), in process for what a
run reads later (an RL prompt row, the tokenizer trainer's corpus row, an HF folder's index and a PEFT folder's
adapter_config.json, an image cut short). Before this, the config.json under ``model.hf_config`` ended with
``error: Expecting value: line 1 column 40 (char 39)`` (no file), a bad safetensors header gave a traceback, and a bad
tokenizer passed the check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchtitan.preflight.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
HF_CONFIG = ["--job.config_file", "train_configs/hf_debug.toml", "--model.flavor", "config", "--model.hf_config"]
SFT_TOKENIZER = ROOT / "tests" / "assets" / "sft" / "tokenizer"
LLAMA = '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}'


def _preflight(capsys, monkeypatch, tmp_path, *args: str) -> str:
    """The one error line (exit 2, nothing on stdout)."""
    monkeypatch.chdir(ROOT)
    code = main([*args, "--job.dump_folder", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert (code, out, err.count("\n")) == (2, "", 1), (code, out, err)
    return err


def _hf_folder(folder: Path, config: str = LLAMA, weights: bytes | None = None) -> Path:
    import torch
    from safetensors.torch import save

    folder.mkdir()
    (folder / "config.json").write_text(config)
    (folder / "model.safetensors").write_bytes(weights or save({"model.norm.weight": torch.ones(64)}))
    return folder


def test_a_toml_config(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = 3\nlr = = 2\n")
    err = _preflight(capsys, monkeypatch, tmp_path, "--job.config_file", str(bad))
    assert err == f"error: {bad}: line 3, column 6: not valid TOML (Invalid value); fix that line\n"


def test_an_hf_config_json(tmp_path, capsys, monkeypatch):
    """issue 84's: a config.json that is not valid JSON under model.hf_config (its folder, or the file)."""
    folder = _hf_folder(tmp_path / "hf", '{"model_type": "llama", "hidden_size": ,}')
    for source in (folder, folder / "config.json"):
        err = _preflight(capsys, monkeypatch, tmp_path, *HF_CONFIG, str(source))
        assert err.startswith(f"error: {folder / 'config.json'}: line 1, column 40: not valid JSON (Expecting value)")
    err = _preflight(capsys, monkeypatch, tmp_path, *HF_CONFIG, '{"model_type": "llama",}')
    assert err.startswith("error: model.hf_config: line 1, column 24: not valid JSON (Expecting property name")


def test_a_safetensors_header(tmp_path, capsys, monkeypatch):
    folder = _hf_folder(tmp_path / "hf", weights=b"\x00" * 7 + b"\x01not a header")
    load = ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"]  # llama3's debugmodel
    err = _preflight(capsys, monkeypatch, tmp_path, *load)
    assert err.startswith(f"error: {folder / 'model.safetensors'}: header: not a safetensors file ("), err


def test_tokenizer_files(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    text = (SFT_TOKENIZER / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(text[:300])  # cut inside a string on line 17
    (folder / "tokenizer_config.json").write_text((SFT_TOKENIZER / "tokenizer_config.json").read_text())
    err = _preflight(capsys, monkeypatch, tmp_path, "--model.tokenizer_path", str(folder))
    want = f"error: {folder / 'tokenizer.json'}: line 17, column 11: not a Hugging Face tokenizer.json (EOF while"
    assert err.startswith(want), err
    (folder / "tokenizer.json").write_text(text)
    (folder / "tokenizer_config.json").write_text('{\n  "eos_token": "<|im_end|>"\n  "bos_token": null\n}')
    err = _preflight(capsys, monkeypatch, tmp_path, "--model.tokenizer_path", str(folder))
    assert err.startswith(f"error: {folder / 'tokenizer_config.json'}: line 3, column 3: not valid JSON ("), err


def test_a_jsonl_row(tmp_path):
    """An RL prompt row and a row of the tokenizer trainer's corpus: the file's line, the row's column."""
    import importlib.util

    from torchtitan.datasets.sft.chat_template import ChatTokenizer
    from torchtitan.features.rl.prompts import PromptSource

    rows = tmp_path / "prompts.jsonl"
    rows.write_text('{"prompt": "1 + 1"}\n\n{"prompt": "2 + 2"\n')
    with pytest.raises(ValueError) as e:
        PromptSource(
            str(rows), ChatTokenizer(str(SFT_TOKENIZER)), seed=0, per_step=1, group_size=1, max_new_tokens=4, seq_len=64
        )
    assert (
        str(e.value)
        == f"rl.prompts_path {rows}: line 3: not valid JSON (Expecting ',' delimiter); fix or remove that row"
    )
    spec = importlib.util.spec_from_file_location("train_tokenizer", ROOT / "scripts" / "train_tokenizer.py")
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    rows.write_text('{"text": "a"}\n{"text": "b",, }\n')
    with pytest.raises(ValueError, match=rf"^{rows}: line 2, column 14: not valid JSON \(Expecting"):
        trainer.read_jsonl_texts(str(rows))


def test_hf_and_peft_json_files(tmp_path):
    from torchtitan.checkpointing.hf.files import hf_weight_files
    from torchtitan.features.lora.peft_io import read_peft_folder
    from torchtitan.spec import get_model_spec

    folder = _hf_folder(tmp_path / "hf")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model.safetensors",}}')
    with pytest.raises(ValueError, match=rf"^{folder}/model.safetensors.index.json: line 1, column 42: not valid"):
        hf_weight_files(str(folder))
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "adapter_config.json").write_text(json.dumps({"r": 4})[:-1])
    (peft / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=rf"^{peft}/adapter_config.json: line 1, column 8: not valid JSON"):
        read_peft_folder(str(peft), get_model_spec("llama3"), {})


def test_an_image_cut_short(tmp_path):
    """Its header reads (the text is laid out), its pixels do not: the file is named where they are decoded."""
    import numpy as np
    from PIL import Image

    from torchtitan.datasets.vision.processor import ImageInfo, ImageProcessor
    from torchtitan.models.qwen3_5.spec import SPECS

    whole, cut = tmp_path / "whole.png", tmp_path / "cut.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(whole)
    cut.write_bytes(whole.read_bytes()[:2000])
    processor = ImageProcessor(SPECS["qwen3_5_vl"].flavors["debugmodel"].vision)
    info = processor.info(str(cut), "row 1")
    with pytest.raises(ValueError, match=rf"^{cut}: not a readable image \("):
        processor.pixels(ImageInfo(info.path, info.grid))
