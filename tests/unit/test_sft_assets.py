"""The shipped fine-tuning assets (tests/assets/sft): what scripts/build_sft_assets.py writes, a tokenizer
that transformers and our ChatTokenizer read alike, and a task whose held-out pairs are never trained."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.datasets.tokenizer import HFTokenizer

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets" / "sft"
TOKENIZER = str(ASSETS / "tokenizer")
DATA_FILES = ("arith_train.jsonl", "arith_val.jsonl", "arith_prompt_completion.jsonl")
PAIR = re.compile(r"(\d+)\D+?(\d+)")


@functools.cache
def _script():
    """scripts/build_sft_assets.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("build_sft_assets", ROOT / "scripts" / "build_sft_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (ASSETS / name).read_text(encoding="utf-8").splitlines()]


def _messages(row: dict) -> list[dict]:
    if "messages" in row:
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]


def _asked(row: dict) -> list[tuple[int, int]]:
    """The (A, B) of each question in a row, checking each answer is A + B."""
    messages = _messages(row)
    pairs = []
    for question, answer in zip(messages, messages[1:]):
        if question["role"] == "user":
            a, b = map(int, PAIR.search(question["content"]).groups())
            assert answer["role"] == "assistant" and re.search(rf"\b{a + b}\.?$", answer["content"]), row
            pairs.append((a, b))
    return pairs


def test_a_rebuild_writes_the_same_assets(tmp_path):
    _script().build_assets(tmp_path)
    for name in (*DATA_FILES, "README.md", "tokenizer/tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (ASSETS / name).read_bytes(), name
    # the tokenizer by content: its JSON layout may change with the tokenizers version
    rebuilt, shipped = (json.loads((p / "tokenizer" / "tokenizer.json").read_text()) for p in (tmp_path, ASSETS))
    for key in ("model", "added_tokens", "pre_tokenizer", "decoder"):
        assert rebuilt[key] == shipped[key], key


def test_transformers_and_chat_tokenizer_give_the_same_ids():
    hf = AutoTokenizer.from_pretrained(TOKENIZER)
    ours = ChatTokenizer(TOKENIZER)
    for name in DATA_FILES:
        for row in _rows(name):
            out = hf.apply_chat_template(_messages(row), tokenize=True)
            assert ours.tokenize_chat(_messages(row))[0] == list(out["input_ids"] if hasattr(out, "keys") else out)


def test_special_tokens_and_digits():
    tok = HFTokenizer(TOKENIZER)
    ids = {t: tok.model.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (-1, 2, 0)
    assert 256 < tok.n_words < 512 and tok.n_words % 16 == 0  # TP shards the vocabulary
    pieces = tok.model.encode("What is 123 plus 45?").tokens
    assert [p for p in pieces if any(c.isdigit() for c in p)] == ["1", "2", "3", "4", "5"], pieces
    assert not [t for t in tok.model.get_vocab() if sum(c.isdigit() for c in t) > 1 and not t.startswith("<|")]


def test_lengths_are_the_readme_s():
    ours = ChatTokenizer(TOKENIZER)
    lengths: dict[int, list[int]] = {1: [], 2: []}
    for name in DATA_FILES:
        for row in _rows(name):
            turns = sum(m["role"] == "assistant" for m in _messages(row))
            lengths[turns].append(len(ours.tokenize_chat(_messages(row))[0]))
    assert (min(lengths[1]), max(lengths[1])) == _script().SINGLE_TURN_TOKENS
    assert (min(lengths[2]), max(lengths[2])) == _script().TWO_TURN_TOKENS


@pytest.mark.parametrize("name", DATA_FILES)
def test_held_out_pairs_are_only_in_val(name):
    asked = [pair for row in _rows(name) for pair in _asked(row)]
    held = [pair for pair in asked if _script().is_held_out(*pair)]
    if name == "arith_val.jsonl":
        everything = range(_script().MAX_OPERAND + 1)
        expected = {(a, b) for a in everything for b in everything if _script().is_held_out(a, b)}
        assert held == asked and len(asked) == len(set(asked)) and set(asked) == expected
    else:
        assert not held
    assert (ASSETS / name).stat().st_size < 150_000
