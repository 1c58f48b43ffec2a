"""``scripts/generate.py --hf FOLDER`` with no other flag on a folder transformers wrote: the folder's own
tokenizer is read (as transformers' AutoTokenizer reads it), and an embedding padded past that tokenizer
(Qwen3's 151,936 rows for 151,669 tokens) is accepted, as the trainer accepts it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.hf import tiny_qwen3
from tests.support.scripts import generate_script
from torchtitan.datasets.tokenizer import build_tokenizer

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "tests" / "assets" / "sft" / "tokenizer")
PADDING = 13  # rows past the tokenizer's words


def _qwen3_folder(folder: Path) -> int:
    """A tiny random Qwen3 saved by transformers with its tokenizer; returns the tokenizer's word count."""
    words = build_tokenizer(TOKENIZER).n_words
    tiny_qwen3(words + PADDING).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return words


def test_generate_answers_from_a_transformers_folder_padded_past_its_tokenizer(tmp_path, capsys):
    words = _qwen3_folder(tmp_path / "qwen3")
    assert generate_script().main(["--hf", str(tmp_path / "qwen3"), "--prompt", "Hello", "--max_new_tokens", "6"]) == 0
    assert capsys.readouterr().out.strip()
    assert generate_script().default_tokenizer(str(tmp_path / "qwen3"), None) == str(tmp_path / "qwen3")
    model = generate_script().load_model(None, str(tmp_path / "qwen3"), 16, words, torch.device("cpu"))
    assert model.tok_embeddings.weight.shape[0] == words + PADDING  # the folder's rows, all of them loaded
    assert model(torch.tensor([[1, 2, 3]])).shape[-1] == words  # the padding rows are never sampled


def test_a_table_smaller_than_the_tokenizer_is_refused(tmp_path):
    words = _qwen3_folder(tmp_path / "qwen3")
    with pytest.raises(ValueError, match=f"vocabulary of {words + PADDING} and the tokenizer {words + 100} words"):
        generate_script().load_model(None, str(tmp_path / "qwen3"), 16, words + 100, torch.device("cpu"))
