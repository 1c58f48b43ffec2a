"""Local data checked as it is loaded: a bad file or row is one error naming the file and the row.

Left to ``datasets``, an empty file raises a bare StopIteration, a malformed JSON line an
ArrowInvalid deep inside a DatasetGenerationError, and a null or non-string text passes the load
and fails only when a stream reaches that row (one rank, hours later, naming neither). Here the
load names the file and line, and the text column is checked at once: its type and null count
are Arrow metadata, so the check costs nothing on a valid dataset; the row-by-row search for the
culprit runs only when there is one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
from datasets import Dataset, load_dataset_builder

_JSON_SUFFIXES = (".json", ".jsonl")


def source_files(path: Path) -> list[Path]:
    """The files ``datasets`` reads for a local file or folder (a folder: its train split, in order)."""
    if not path.is_dir():
        return [path]
    files = load_dataset_builder(str(path)).config.data_files.get("train", [])
    return [Path(f) for f in files]


def check_not_empty(files: list[Path]) -> None:
    """Raise naming the data when none of ``files`` holds anything but whitespace."""
    if not any(f.stat().st_size and _has_text(f) for f in files):
        names = ", ".join(f"'{f}'" for f in files) or "no data files"
        raise ValueError(f"data is empty: {names}; the dataset_path needs files with one document per row")


def _has_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return any(chunk.strip() for chunk in iter(lambda: f.read(1 << 16), b""))


def explain_load_error(files: list[Path], field: str, error: BaseException) -> ValueError:
    """A one-line error for a load that failed: the first bad JSON line, else the loader's own message."""
    for f in files:
        if f.suffix.lower() in _JSON_SUFFIXES:
            bad = _first_bad_json_line(f, field)
            if bad is not None:
                line, why = bad
                return ValueError(f"data file '{f}', line {line}: {why}; fix or remove that line")
    cause = error.__context__ if isinstance(error, ValueError) and error.__context__ else error.__cause__ or error
    where = ", ".join(f"'{f}'" for f in files)
    return ValueError(f"could not read data {where}: {type(cause).__name__}: {cause}")


def _first_bad_json_line(path: Path, field: str) -> tuple[int, str] | None:
    """(line number, what is wrong) of the first line that is not a JSON object whose ``field`` (if
    present) is a string; a file holding one JSON document is not read line by line."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix.lower() == ".json":
        try:
            json.loads(text)
            return None
        except ValueError:
            pass  # not one document: JSON lines
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            return number, f"not valid JSON ({e})"
        if not isinstance(row, dict):
            return number, f"not a JSON object but a {type(row).__name__}"
        if field in row and not isinstance(row[field], str):
            return number, f"{field!r} is {_describe(row[field])}; every row needs a string there"
    return None


def _describe(value: object) -> str:
    return "null" if value is None else f"not a string ({type(value).__name__}: {str(value)[:40]!r})"


def check_text_column(data: Dataset, field: str, files: list[Path]) -> None:
    """Raise naming the file and row of the first row whose ``field`` is null or not a string."""
    if field not in data.column_names:
        return  # the dataset reports a missing field itself, listing the columns
    column = data.data.column(field)
    is_string = str(column.type) in ("string", "large_string")
    if is_string and column.null_count == 0:
        return
    index = pc.index(pc.is_null(column), True).as_py() if is_string else _first_non_string(data, field)
    if index < 0:
        return
    raise ValueError(
        f"{_locate(index, files)}: {field!r} is {_describe(data[index][field])}; every row needs a string "
        "there; fix or remove that row"
    )


def _first_non_string(data: Dataset, field: str) -> int:
    offset = 0
    for batch in data.select_columns([field]).iter(batch_size=1024):
        for i, value in enumerate(batch[field]):
            if not isinstance(value, str):
                return offset + i
        offset += len(batch[field])
    return -1


def _locate(index: int, files: list[Path]) -> str:
    """Where dataset row ``index`` comes from: "data file X, line N" (JSON lines) or "..., row N" (parquet)."""
    remaining = index
    for f in files:
        suffix = f.suffix.lower()
        if suffix in _JSON_SUFFIXES and not _starts_with(f, "["):  # JSON lines: blank lines are no rows
            with open(f, encoding="utf-8", errors="replace") as fp:
                for number, line in enumerate(fp, start=1):
                    if line.strip():
                        if remaining == 0:
                            return f"data file '{f}', line {number}"
                        remaining -= 1
        elif suffix == ".parquet":
            rows = pq.ParquetFile(f).metadata.num_rows
            if remaining < rows:
                return f"data file '{f}', row {remaining + 1}"
            remaining -= rows
        else:
            break  # rows of other layouts (a JSON array, text) are not traced back to a line
    names = ", ".join(f"'{f}'" for f in files)
    return f"data row {index} (0-based) of {names}"


def _starts_with(path: Path, char: str) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(4096).lstrip().startswith(char)
