"""Megatron-LM's indexed format: scripts/tokenize_data.py writes what megatron-core's IndexedDatasetBuilder writes,
byte for byte, whatever --workers is; each side reads the other's files; bad files are one line each."""

from __future__ import annotations

import io
import os
import struct

import numpy as np
import pytest
import torch

from tests.support.indexed import TOKENIZER, write_jsonl
from torchtitan.datasets.indexed.format import HEADER_BYTES, IndexedFile, check_vocab, dtype_for_vocab, find_prefixes
from torchtitan.datasets.indexed.tokenize import Progress, tokenize_to_indexed
from torchtitan.datasets.tokenizer import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = [
    "def f(x):\n    return x + 1\n",
    "The quick brown fox jumps over the lazy dog. " * 7,
    "",  # an empty document is still one: bos + eos
    "Unicode: naïve café, 数据, emoji \U0001f600 and a tab\there.",
    *(f"document {i}: " + "lorem ipsum " * (i % 13) for i in range(600)),  # > 2 chunks of 256 documents
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    """(folder, the jsonl) of a small corpus written for the test."""
    folder = tmp_path_factory.mktemp("indexed")
    return str(folder), write_jsonl(folder / "corpus.jsonl", TEXTS)


def tokenize(corpus: tuple[str, str], name: str, workers: int) -> str:
    prefix = os.path.join(corpus[0], name)
    summary = tokenize_to_indexed(corpus[1], prefix, TOKENIZER, workers=workers, progress=io.StringIO())
    assert (summary.documents, summary.bytes) == (
        len(TEXTS),
        os.path.getsize(prefix + ".bin") + os.path.getsize(prefix + ".idx"),
    )
    return prefix


def read_bytes(prefix: str) -> tuple[bytes, bytes]:
    with open(prefix + ".bin", "rb") as b, open(prefix + ".idx", "rb") as i:
        return b.read(), i.read()


# megatron-core warns at import (no Transformer Engine / Apex) and on every add_document (numpy's __array__ copy)
@pytest.mark.filterwarnings("ignore")
def test_tokenize_data_equals_megatron_builder_and_workers_do_not_matter(corpus):
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

    tok = build_tokenizer(TOKENIZER)
    one, two = tokenize(corpus, "ours_w1", 1), tokenize(corpus, "ours_w2", 2)
    assert read_bytes(one) == read_bytes(two), "the output depends on --workers"
    # Megatron's tools/preprocess_data.py: a builder of DType.optimal_dtype(vocab), one add_document per row
    dtype = DType.optimal_dtype(tok.n_words)
    assert dtype == dtype_for_vocab(tok.n_words) == np.uint16
    theirs = os.path.join(corpus[0], "megatron")
    builder = IndexedDatasetBuilder(theirs + ".bin", dtype=dtype)
    docs = [tok.encode(t, bos=True, eos=True) for t in TEXTS]
    for ids in docs:
        builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(theirs + ".idx")
    assert read_bytes(one) == read_bytes(theirs), "tokenize_data.py's files differ from IndexedDatasetBuilder's"
    # each reads the other's: Megatron's reader our documents, ours Megatron's token stream
    dataset = IndexedDataset(one)
    assert len(dataset) == len(docs) and all(list(dataset[i]) == docs[i] for i in (0, 2, 3, len(docs) - 1))
    mine = IndexedFile(theirs)
    assert mine.dtype == np.uint16 and mine.num_tokens == sum(map(len, docs))
    assert mine.tokens[0 : mine.num_tokens].tolist() == [t for d in docs for t in d]
    assert mine.tokens[5:9].tolist() == [t for d in docs for t in d][5:9]
    assert find_prefixes(theirs + ".idx") == find_prefixes(theirs + ".bin") == find_prefixes(theirs) == [theirs]


def test_interrupted_write_leaves_nothing_under_the_final_names(corpus, monkeypatch):
    from torchtitan.datasets.indexed import tokenize as tokenize_module

    prefix = os.path.join(corpus[0], "interrupted")
    calls = {"n": 0}
    real = tokenize_module.encode_chunk

    def interrupted(texts, tokenizer=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(texts, tokenizer)

    monkeypatch.setattr(tokenize_module, "encode_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tokenize_to_indexed(corpus[1], prefix, TOKENIZER, progress=io.StringIO())
    assert not [n for n in os.listdir(corpus[0]) if n.startswith("interrupted")]
    monkeypatch.setattr(tokenize_module, "encode_chunk", real)
    tokenize_to_indexed(corpus[1], prefix, TOKENIZER, progress=io.StringIO())  # the rerun starts over
    assert read_bytes(prefix) == read_bytes(tokenize(corpus, "ours_w1", 1))


def test_progress_is_plain_lines_when_redirected_and_the_script_prints_one_summary(corpus, capsys):
    stream = io.StringIO()
    bar = Progress(10, stream, interval=0.0)
    bar.update(5, 500)
    bar.update(10, 1000, final=True)
    assert stream.getvalue().startswith("tokenize: 5/10 documents (50%)") and "\r" not in stream.getvalue()
    assert "tokens/s" in stream.getvalue() and "ETA" in stream.getvalue()

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    bar = Progress(10, tty, interval=0.0)
    bar.update(5, 500)
    bar.update(10, 1000, final=True)
    drawn = tty.getvalue()
    assert drawn.startswith("\r[##########..........] 5/10 documents (50%)") and drawn.count("\r") == 2
    assert drawn.endswith("ETA 0 s\n") and "[####################] 10/10" in drawn
    import importlib.util

    spec = importlib.util.spec_from_file_location("tokenize_data", os.path.join(ROOT, "scripts", "tokenize_data.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    prefix = os.path.join(corpus[0], "cli")
    assert script.main(["--input", corpus[1], "--output_prefix", prefix, "--workers", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"tokenized {len(TEXTS)} documents, ") and " bytes " in out[0]
    assert script.main(["--input", os.path.join(corpus[0], "nope.jsonl"), "--output_prefix", prefix]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.jsonl" in err[0], err


def _corrupt(prefix: str, offset: int, data: bytes) -> None:
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("magic", "is not a Megatron-LM indexed dataset index"),
        ("version", "is index version 2; only version 1"),
        ("dtype", "has token dtype code 7; token ids need an integer code"),
        ("float_dtype", "has token dtype code 6"),
        ("short_bin", "shorter than the"),
        ("short_idx", "the file is truncated"),
        ("no_idx", ".idx' is missing"),
        ("no_bin", ".bin' is missing"),
    ],
)
def test_bad_files_are_one_line(corpus, tmp_path, damage, message):
    src = tokenize(corpus, "ours_w1", 1)
    prefix = str(tmp_path / "bad")
    for suffix in (".bin", ".idx"):
        with open(src + suffix, "rb") as f, open(prefix + suffix, "wb") as g:
            g.write(f.read())
    if damage == "magic":
        _corrupt(prefix, 0, b"NOTMMIDX\x00")
    elif damage == "version":
        _corrupt(prefix, 9, struct.pack("<Q", 2))
    elif damage in ("dtype", "float_dtype"):
        _corrupt(prefix, 17, bytes([7 if damage == "dtype" else 6]))
    elif damage == "short_bin":
        os.truncate(prefix + ".bin", os.path.getsize(prefix + ".bin") - 2)
    elif damage == "short_idx":
        os.truncate(prefix + ".idx", HEADER_BYTES + 100)
    else:
        os.remove(prefix + (".idx" if damage == "no_idx" else ".bin"))
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        for p in find_prefixes(prefix + ".bin"):
            IndexedFile(p)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_token_id_beyond_the_vocabulary_is_one_line_and_the_scan_is_cached(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = IndexedFile(tokenize(corpus, "ours_w1", 1))
    check_vocab(src, 2304, "x")  # the shipped tokenizer's 2304 words: every id fits
    assert len(os.listdir(tmp_path / "cache" / "torchtitan" / "indexed_max_id")) == 1
    with pytest.raises(ValueError) as e:
        check_vocab(src, 300, "training.dataset_path")
    assert "outside the model's vocabulary [0, 300)" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.filterwarnings("ignore")
def test_blend_rule_is_megatrons():
    """Our blending rule picks the same source as megatron-core's compiled build_blending_indices, sample by sample."""
    from megatron.core.datasets import helpers

    from torchtitan.datasets.indexed.blend import BlendRule

    for weights in ([0.7, 0.2, 0.1], [1 / 3] * 3, [0.5, 0.3, 0.15, 0.05]):
        size = 20_000
        index, sample = np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64)
        helpers.build_blending_indices(index, sample, np.array(weights), len(weights), size, False)
        rule = BlendRule(weights)
        assert [rule.next() for _ in range(size)] == index.tolist(), weights
