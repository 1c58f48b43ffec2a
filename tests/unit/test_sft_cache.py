"""Fine-tuning rows are tokenized once: a second build reads the cache, a changed file or setting tokenizes
again, and of two processes asking at once only one tokenizes (datasets/sft/cache.py)."""

from __future__ import annotations

import multiprocessing
import shutil
import time
from array import array
from pathlib import Path

import pytest

from torchtitan.datasets.sft import loader
from torchtitan.datasets.sft.cache import cached_examples
from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.datasets.sft.columns import ColumnMap

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "sft"


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer(str(ASSETS / "tokenizer"))


def _build(path: Path, chat: ChatTokenizer, loss_on: str = "assistant"):
    sources = loader.load_rows("sft_arith", str(path))
    return loader.tokenize_cached(sources, chat, fmt="chat", loss_on=loss_on, columns=ColumnMap())


def test_second_build_reads_the_cache_and_changes_tokenize_again(tmp_path, chat, monkeypatch):
    data = tmp_path / "chat.jsonl"
    shutil.copy(ASSETS / "arith_val.jsonl", data)
    calls = []
    real = loader.tokenize_rows
    monkeypatch.setattr(loader, "tokenize_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = _build(data, chat)
    again = _build(data, chat)
    assert len(calls) == 1 and [list(t) for t, _ in again] == [list(t) for t, _ in first]
    assert [list(lab) for _, lab in again] == [list(lab) for _, lab in first]
    assert list((tmp_path / ".torchtitan_cache").glob("sft-*.npz"))
    _build(data, chat, loss_on="all")  # another setting: another key
    assert len(calls) == 2
    time.sleep(0.01)
    with open(data, "a") as f:
        f.write(data.read_text().splitlines()[0] + "\n")  # the data changed: tokenized again
    assert len(_build(data, chat)) == len(first) + 1 and len(calls) == 3


def _worker(folder: str, marks: str) -> None:
    def tokenize():
        with open(marks, "a") as f:
            f.write("x")
        time.sleep(0.5)  # long enough for the other process to reach the lock
        return [(array("i", [1, 2, 3]), array("i", [2, 3, -100]))]

    examples, _ = cached_examples(Path(folder), "k" * 32, tokenize)
    assert [list(t) for t, _ in examples] == [[1, 2, 3]]


def test_of_two_processes_only_one_tokenizes(tmp_path):
    marks = tmp_path / "marks"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), str(marks))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert marks.read_text() == "x"
