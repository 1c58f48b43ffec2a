"""Data pipeline: layout invariance, exact resume, stream redistribution, sources and errors."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pandas as pd
import pytest
import torch
from datasets import Dataset

from torchtitan.datasets import registry
from torchtitan.datasets.hf_datasets import (
    HuggingFaceDataset,
    build_hf_data_loader,
    compute_stream_groups,
    merge_data_states,
)
from torchtitan.datasets.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer, build_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
SEQ_LEN = 16


def _doc(i: int) -> str:
    # varied lengths so streams consume documents at different rates
    return f"document {i}: " + " ".join(f"w{i}x{j}" for j in range(3 + (i * 7) % 11))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return build_tokenizer(str(REPO_ROOT / DEFAULT_TOKENIZER_PATH))


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("data") / "tiny.jsonl"
    path.write_text("".join(json.dumps({"text": _doc(i), "id": i}) + "\n" for i in range(30)))
    return str(path)


def _loader(jsonl: str, tokenizer: Tokenizer, dp_rank: int, dp: int, b: int, a: int):
    groups = compute_stream_groups(dp_rank, dp, b, a)
    return build_hf_data_loader("c4_test", jsonl, tokenizer, SEQ_LEN, groups, num_streams=dp * b * a)


def _global_steps(loaders: list, num_steps: int, a: int) -> list[torch.Tensor]:
    """Per optimizer step: all ranks' micro-batch inputs concatenated in rank, then group order."""
    iters = [iter(dl) for dl in loaders]
    steps = []
    for _ in range(num_steps):
        rows = []
        for it in iters:
            for _ in range(a):
                inputs, labels = next(it)
                assert inputs.shape == labels.shape and inputs.shape[1] == SEQ_LEN and inputs.dtype == torch.long
                rows.append(torch.cat([inputs, labels[:, -1:]], dim=1))
        steps.append(torch.cat(rows))
    return steps


def test_compute_stream_groups() -> None:
    assert compute_stream_groups(0, 1, 8, 1) == [list(range(8))]
    assert compute_stream_groups(1, 2, 2, 2) == [[4, 5], [6, 7]]
    flat = [s for r in range(3) for g in compute_stream_groups(r, 3, 2, 4) for s in g]
    assert flat == list(range(24))
    with pytest.raises(ValueError, match="dp_rank"):
        compute_stream_groups(2, 2, 1, 1)
    with pytest.raises(ValueError, match="grad_accum_steps"):
        compute_stream_groups(0, 1, 1, 0)


def test_layout_invariance(jsonl: str, tokenizer: Tokenizer) -> None:
    one_rank = _global_steps([_loader(jsonl, tokenizer, 0, 1, 8, 1)], 6, a=1)
    two_ranks = _global_steps([_loader(jsonl, tokenizer, r, 2, 4, 1) for r in range(2)], 6, a=1)
    accum = _global_steps([_loader(jsonl, tokenizer, r, 2, 2, 2) for r in range(2)], 6, a=2)
    for x, y, z in zip(one_rank, two_ranks, accum, strict=True):
        assert x.shape == (8, SEQ_LEN + 1)
        assert torch.equal(x, y) and torch.equal(x, z)
    # stream s starts with document s: row s of step 0 begins with bos then "document s"
    first = one_rank[0]
    assert (first[:, 0] == tokenizer.bos_id).all()
    assert tokenizer.decode(first[3, 1:].tolist()).startswith("document 3:")


def test_resume_mid_step_is_exact(jsonl: str, tokenizer: Tokenizer) -> None:
    dl = _loader(jsonl, tokenizer, 0, 1, 2, 3)
    it = iter(dl)
    for _ in range(7):  # 2 steps and 1 of 3 micro-batches
        next(it)
    state = copy.deepcopy(dl.state_dict())
    expected = [next(it) for _ in range(8)]
    resumed = _loader(jsonl, tokenizer, 0, 1, 2, 3)
    resumed.load_state_dict(state)
    got = [b for b, _ in zip(resumed, range(8))]
    for (x0, y0), (x1, y1) in zip(expected, got, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_redistribute_streams_to_other_dp_degree(jsonl: str, tokenizer: Tokenizer) -> None:
    reference = _global_steps([_loader(jsonl, tokenizer, 0, 1, 8, 1)], 6, a=1)
    ranks = [_loader(jsonl, tokenizer, r, 2, 2, 2) for r in range(2)]
    _global_steps(ranks, 3, a=2)
    states = [dl.state_dict() for dl in ranks]
    single = _loader(jsonl, tokenizer, 0, 1, 8, 1)
    with pytest.raises(ValueError, match=r"lacks streams \[4, 5, 6, 7\]"):
        single.load_state_dict(states[0])
    single.load_state_dict(merge_data_states(states))
    for x, y in zip(reference[3:], _global_steps([single], 3, a=1), strict=True):
        assert torch.equal(x, y)
    # and the other way: a superset state feeds a rank that takes only its own streams
    rank1_of_4 = _loader(jsonl, tokenizer, 1, 4, 2, 1)
    rank1_of_4.load_state_dict(single.state_dict())
    assert torch.equal(_global_steps([rank1_of_4], 1, a=1)[0], _global_steps([single], 1, a=1)[0][2:4])


def test_state_mismatch_rejected(jsonl: str, tokenizer: Tokenizer) -> None:
    state = _loader(jsonl, tokenizer, 0, 1, 4, 1).state_dict()
    with pytest.raises(ValueError, match="num_streams, seq_len"):
        _loader(jsonl, tokenizer, 0, 1, 8, 1).load_state_dict(state)


def test_looping_over_the_end_logged_once_per_epoch(
    jsonl: str, tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    dl = _loader(jsonl, tokenizer, 0, 1, 4, 1)
    with caplog.at_level(logging.WARNING, logger="torchtitan.datasets.hf_datasets"):
        _global_steps([dl], 40, a=1)  # about 3 passes over the 30 documents
    messages = [r.getMessage() for r in caplog.records if "looping over the end" in r.getMessage()]
    assert messages[0] == "dataset c4_test: looping over the end (epoch 1)"
    assert len(messages) == len(set(messages)) >= 2


def test_streaming_source_matches_map_style(tokenizer: Tokenizer) -> None:
    data = Dataset.from_list([{"text": _doc(i)} for i in range(23)])

    def build(d, groups):
        return HuggingFaceDataset("mem", d, "text", tokenizer, SEQ_LEN, groups, num_streams=6)

    groups = compute_stream_groups(1, 2, 3, 1)  # streams 3..5: documents of streams 0..2 are skipped
    mapped, streamed = iter(build(data, groups)), build(data.to_iterable_dataset(), groups)
    expected = [next(mapped)[0] for _ in range(30)]  # loops over the data several times
    it = iter(streamed)
    got = [next(it)[0] for _ in range(12)]
    resumed = build(data.to_iterable_dataset(), groups)
    resumed.load_state_dict(copy.deepcopy(streamed.state_dict()))
    got += [x for (x, _), _ in zip(resumed, range(18))]
    assert all(torch.equal(x, y) for x, y in zip(expected, got, strict=True))


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".txt"])
def test_local_files_through_hub_dataset_name(tmp_path: Path, tokenizer: Tokenizer, suffix: str) -> None:
    texts = [_doc(i) for i in range(12)]
    path = tmp_path / f"shard{suffix}"
    if suffix == ".parquet":
        pd.DataFrame({"text": texts, "url": ["u"] * 12}).to_parquet(path)
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    else:
        path.write_text("\n".join(texts) + "\n")
    dl = build_hf_data_loader("c4", str(path), tokenizer, SEQ_LEN, [[0, 1]], num_streams=2)
    inputs, labels = next(iter(dl))
    assert inputs.shape == (2, SEQ_LEN)
    assert tokenizer.decode(inputs[1, 1:].tolist()).startswith("document 1:")


def test_shipped_default_dataset_loads(tokenizer: Tokenizer) -> None:
    dl = build_hf_data_loader("pydocs", None, tokenizer, 64, [[0, 1]], num_streams=2)
    inputs, labels = next(iter(dl))
    assert inputs.shape == (2, 64) and torch.equal(inputs[:, 1:], labels[:, :-1])


def test_errors(tmp_path: Path, jsonl: str, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ValueError, match=r"unknown dataset 'c5'.*'c4', 'c4_test', 'c4_validation', 'fineweb', 'pydocs'"
    ):
        build_hf_data_loader("c5", None, tokenizer, SEQ_LEN, [[0]], 1)
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        build_hf_data_loader("c4", missing, tokenizer, SEQ_LEN, [[0]], 1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_hf_data_loader("pydocs", "someone/not-local", tokenizer, SEQ_LEN, [[0]], 1)
    monkeypatch.setitem(registry.DATASETS, "c4_test", registry.DatasetSpec(default_path=tmp_path / "c4_test"))
    with pytest.raises(FileNotFoundError, match="c4_test"):
        build_hf_data_loader("c4_test", None, tokenizer, SEQ_LEN, [[0]], 1)
    with pytest.raises(ValueError, match="fewer than one sample"):
        build_hf_data_loader("c4", jsonl, tokenizer, 100_000, [[0]], 1)
    bad = tmp_path / "data.csv"
    bad.write_text("text\nhello\n")
    with pytest.raises(ValueError, match="unsupported data file"):
        build_hf_data_loader("c4", str(bad), tokenizer, SEQ_LEN, [[0]], 1)
    with pytest.raises(ValueError, match="distinct ids"):
        build_hf_data_loader("c4", jsonl, tokenizer, SEQ_LEN, [[0, 0]], 2)


@pytest.mark.parametrize("level", ["info", "debug"])
def test_datasets_progress_bars_show_at_the_runs_debug_level_only(
    tmp_path: Path, capsys: pytest.CaptureFixture, level: str
) -> None:
    """Issue 56, item 7: datasets' "Generating train split" bar (the first read of a file) is the run's DEBUG detail."""
    from torchtitan.observability.logging import IMPORT_NOTES, set_log_level

    path = tmp_path / "fresh.jsonl"  # a file datasets has not cached: it builds it, with its bar
    path.write_text("".join(json.dumps({"text": _doc(i)}) + "\n" for i in range(3)))
    loggers = [logging.getLogger(), *map(logging.getLogger, IMPORT_NOTES)]
    before = [lg.level for lg in loggers]
    try:
        set_log_level(level)
        assert len(registry.load_local(path, "text")) == 3
    finally:
        for lg, was in zip(loggers, before):
            lg.setLevel(was)
    assert ("Generating train split" in capsys.readouterr().err) == (level == "debug")
