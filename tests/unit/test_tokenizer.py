"""Tokenizer: the shipped BPE model, Llama 3 special-token layout, long inputs, errors, BPE training."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from torchtitan.datasets.tokenizer import TikTokenizer, Tokenizer, build_tokenizer
from torchtitan.datasets.tokenizer.tiktoken import load_bpe_ranks, split_long_runs

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_BPE = REPO_ROOT / "torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken"
SHIPPED_CORPUS = REPO_ROOT / "torchtitan/datasets/assets/pydocs/pydocs.jsonl"


@pytest.fixture(scope="module")
def tokenizer() -> TikTokenizer:
    tok = build_tokenizer(str(SHIPPED_BPE))
    assert isinstance(tok, TikTokenizer) and isinstance(tok, Tokenizer)
    return tok


@pytest.fixture(scope="module")
def trainer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_tokenizer", REPO_ROOT / "scripts/train_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_vocab_and_special_ids(tokenizer: TikTokenizer) -> None:
    assert len(load_bpe_ranks(str(SHIPPED_BPE))) == 2048
    assert tokenizer.n_words == 2048 + 256
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (2048, 2049, -1)
    special = tokenizer.special_tokens
    assert len(special) == 256 and sorted(special.values()) == list(range(2048, 2304))
    # Llama 3 layout: header ids at 6/7, eot at 9, reserved 4 between them, reserved 5.. after
    assert special["<|start_header_id|>"] == 2048 + 6
    assert special["<|end_header_id|>"] == 2048 + 7
    assert special["<|reserved_special_token_4|>"] == 2048 + 8
    assert special["<|eot_id|>"] == 2048 + 9
    assert special["<|reserved_special_token_5|>"] == 2048 + 10
    assert special["<|reserved_special_token_250|>"] == 2048 + 255


def test_round_trip_on_corpus_sample(tokenizer: TikTokenizer) -> None:
    with SHIPPED_CORPUS.open(encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(40), f)]
    texts.append("Ünïcödé ✓ 日本語 emoji 🚀 and tabs\t\tand\r\nnewlines")
    for text in texts:
        ids = tokenizer.encode(text, bos=True, eos=True)
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        assert all(0 <= i < tokenizer.n_words for i in ids)
        assert tokenizer.decode(ids[1:-1]) == text
    assert tokenizer.encode("", bos=False, eos=False) == []


def test_special_token_text_is_ordinary_text(tokenizer: TikTokenizer) -> None:
    text = "a web page that says <|end_of_text|> and <|begin_of_text|>"
    ids = tokenizer.encode(text, bos=False, eos=False)
    assert not set(ids) & set(tokenizer.special_tokens.values())
    assert tokenizer.decode(ids) == text


def test_long_strings(tokenizer: TikTokenizer) -> None:
    text = " " * 300_000 + "x" * 60_000 + " end" + "ab\n" * 100_000  # > MAX_ENCODE_CHARS in all
    assert tokenizer.decode(tokenizer.encode(text, bos=False, eos=False)) == text
    pieces = list(split_long_runs("a" * 10 + " " * 7 + "b", max_run=4))
    assert "".join(pieces) == "a" * 10 + " " * 7 + "b"
    assert all(len(run) <= 4 for p in pieces for run in p.split()) and max(map(len, pieces)) <= 8


def test_missing_file_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.model"
    with pytest.raises(FileNotFoundError, match="download_tokenizer.py") as e:
        build_tokenizer(str(missing))
    assert str(missing) in str(e.value)


def test_malformed_file_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("not a tiktoken line at all\n")
    with pytest.raises(ValueError, match="tiktoken BPE format"):
        build_tokenizer(str(bad))


def test_bpe_trainer_writes_a_file_tiktoken_agrees_with(trainer: ModuleType, tmp_path: Path) -> None:
    texts = ["the cat sat on the mat; the cat ate the rat.", "A theme: thesis, then theory, 1234 cats!"] * 20
    counts = trainer.count_words(texts)
    vocab = trainer.train_bpe(counts, vocab_size=280)
    assert vocab[:256] == [bytes([b]) for b in range(256)] and len(vocab) == 280
    assert len(set(vocab)) == len(vocab)
    assert vocab == trainer.train_bpe(counts, vocab_size=280)  # deterministic
    path = tmp_path / "tiny.tiktoken"
    trainer.write_tiktoken_bpe(vocab, str(path))
    enc = trainer.load_encoding(str(path))
    assert trainer.find_unreachable(enc, vocab) == []  # tiktoken's merge order rebuilds every rank
    assert trainer.check_round_trip(enc, texts) > 1.5  # merges actually compress
    tok = TikTokenizer(str(path))
    assert tok.n_words == 280 + 256
    assert tok.decode(tok.encode(texts[1], bos=True, eos=False)[1:]) == texts[1]
    with pytest.raises(ValueError, match="vocab_size"):
        trainer.train_bpe(counts, vocab_size=100)
