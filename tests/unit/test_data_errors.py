"""Bad local data is one error naming the file and the line (or row), raised when the data is loaded."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset

from torchtitan.config.schema import DatasetName
from torchtitan.datasets.hf_datasets import HuggingFaceDataset
from torchtitan.datasets.registry import DATASETS, load_text_dataset
from torchtitan.datasets.tokenizer import DEFAULT_TOKENIZER_PATH, build_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
GOOD = json.dumps({"text": "a document of a few words " * 4})


def _write(path: Path, *lines: str) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _error(path: str) -> str:
    with pytest.raises(ValueError) as e:
        load_text_dataset("c4_test", path)
    return str(e.value)


def test_the_config_knows_every_registered_dataset_name():
    assert set(typing.get_args(DatasetName)) == set(DATASETS)


def test_empty_data_is_named(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    assert _error(str(tmp_path / "empty.jsonl")).startswith(f"data is empty: '{tmp_path / 'empty.jsonl'}'")
    blank = _write(tmp_path / "blank.jsonl", "", "   ")
    assert _error(blank).startswith(f"data is empty: '{blank}'")


def test_a_malformed_json_line_is_named(tmp_path):
    path = _write(tmp_path / "bad.jsonl", GOOD, GOOD, '{"text": "cut', GOOD)
    assert _error(path).startswith(f"data file '{path}', line 3: not valid JSON (")


@pytest.mark.parametrize(
    "bad, what",
    [('{"text": null}', "is null"), ('{"text": 5}', "is not a string (int: '5')")],
    ids=["null", "int"],
)
def test_a_row_whose_text_is_not_a_string_is_named_at_load(tmp_path, bad, what):
    path = _write(tmp_path / "rows.jsonl", GOOD, "", GOOD, bad, GOOD)  # the blank line is no row
    assert _error(path).startswith(f"data file '{path}', line 4: 'text' {what}; ")


def test_the_bad_row_is_traced_to_its_file_in_a_folder(tmp_path):
    _write(tmp_path / "a.jsonl", GOOD, GOOD)
    second = _write(tmp_path / "b.jsonl", GOOD, '{"text": null}')
    assert _error(str(tmp_path)).startswith(f"data file '{second}', line 2: 'text' is null")


def test_a_parquet_row(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": ["a b c", None, "d e f"]}), path)
    assert _error(str(path)).startswith(f"data file '{path}', row 2: 'text' is null")


def test_a_streamed_row_is_checked_when_it_is_read():
    """Streamed (hub) data cannot be checked at load: the pipeline names the row when it reaches it."""
    tokenizer = build_tokenizer(str(REPO_ROOT / DEFAULT_TOKENIZER_PATH))
    data = Dataset.from_dict({"text": ["words " * 40, None]})
    ds = HuggingFaceDataset("c4", data, "text", tokenizer, seq_len=8, stream_groups=[[0, 1]], num_streams=2)
    with pytest.raises(ValueError, match=r"dataset 'c4', row 1: the text is null, not a string"):
        next(iter(ds))
