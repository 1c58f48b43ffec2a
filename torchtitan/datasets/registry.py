"""Named text datasets: where each comes from and which field holds the text.

Loading is lazy (nothing here touches the network at import time) and local data never goes
near the hub: a local file or folder is read with `datasets`' packaged builders.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset, IterableDataset, load_dataset
from datasets.exceptions import DatasetGenerationError
from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

from torchtitan.datasets.local_files import check_not_empty, check_text_column, explain_load_error, source_files

logger = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[2]
# builder name of `datasets` for each local file type we accept
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}

HFDataset = Dataset | IterableDataset


@dataclass(frozen=True)
class DatasetSpec:
    """How to load a named dataset when the user gives no `dataset_path` (or gives a hub id)."""

    hub_id: str | None = None  # streamed from the hub; None: local only
    hub_config: str | None = None
    hub_split: str = "train"
    default_path: Path | None = None  # local default, read map-style
    text_field: str = "text"


DATASETS: dict[str, DatasetSpec] = {
    # the offline default: Python's own docs, built by scripts/build_default_corpus.py
    "pydocs": DatasetSpec(default_path=_REPO_ROOT / "torchtitan/datasets/assets/pydocs/pydocs.jsonl"),
    # held out from pydocs (every 20th document): the default validation set
    "pydocs_val": DatasetSpec(default_path=_REPO_ROOT / "torchtitan/datasets/assets/pydocs/pydocs_val.jsonl"),
    "c4": DatasetSpec(hub_id="allenai/c4", hub_config="en"),
    "c4_test": DatasetSpec(default_path=_REPO_ROOT / "tests/assets/c4_test"),
    # torchtitan 2025's validation set: c4's validation split, streamed
    "c4_validation": DatasetSpec(hub_id="allenai/c4", hub_config="en", hub_split="validation"),
    "fineweb": DatasetSpec(hub_id="HuggingFaceFW/fineweb"),
    # fine-tuning (training.dataset_format = "chat"): the shipped synthetic chat task, by scripts/build_sft_assets.py
    "sft_arith": DatasetSpec(default_path=_REPO_ROOT / "tests/assets/sft/arith_train.jsonl"),
    "sft_arith_val": DatasetSpec(default_path=_REPO_ROOT / "tests/assets/sft/arith_val.jsonl"),
    # image-text fine-tuning: the synthetic shapes task, written by `python scripts/build_vlm_assets.py --output
    # outputs/vlm_shapes` (docs/vision.md)
    "vlm_shapes": DatasetSpec(default_path=_REPO_ROOT / "outputs/vlm_shapes/shapes_train.jsonl"),
    "vlm_shapes_val": DatasetSpec(default_path=_REPO_ROOT / "outputs/vlm_shapes/shapes_val.jsonl"),
}
DEFAULT_DATASET = "pydocs"


def get_spec(dataset_name: str) -> DatasetSpec:
    if dataset_name not in DATASETS:
        raise ValueError(
            f"unknown dataset {dataset_name!r}; valid names: {sorted(DATASETS)}; "
            f"use dataset_path to read other local data through one of them"
        )
    return DATASETS[dataset_name]


def looks_like_hub_id(path: str) -> bool:
    # "owner/name" with no local-path markers and no file suffix we would read locally
    parts = path.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not path.startswith((".", "~"))
        and Path(path).suffix.lower() not in _FILE_BUILDERS
    )


@contextmanager
def _quiet_load() -> Iterator[None]:
    """datasets' progress bars ("Generating train split", the first read of a file) are the run's DEBUG detail
    (``job.log_level``); its JSON reader's "Failed to load JSON" line never shows: our error names the file and line."""
    json_logger = logging.getLogger("datasets.packaged_modules.json.json")
    level, bars = json_logger.level, not are_progress_bars_disabled()
    json_logger.setLevel(logging.CRITICAL)
    if bars and not logging.getLogger().isEnabledFor(logging.DEBUG):
        disable_progress_bars()
    try:
        yield
    finally:
        json_logger.setLevel(level)
        if bars and are_progress_bars_disabled():
            enable_progress_bars()


def load_local(path: Path, text_field: str | None) -> Dataset:
    """A local file (.json/.jsonl/.parquet/.txt) or folder, map-style (random access by index).

    ``text_field``: the column every row must hold as a string (checked), or None (fine-tuning rows,
    checked row by row as they are read).

    Raises:
        ValueError: empty data, a malformed JSON line, a row whose text is null or not a string
            (each naming the file and line or row; see local_files.py).
    """
    builder = _FILE_BUILDERS.get(path.suffix.lower())
    if builder is None and not path.is_dir():
        raise ValueError(
            f"unsupported data file {str(path)!r}: suffix {path.suffix!r} not in {sorted(_FILE_BUILDERS)}; "
            f"convert it or pass a folder of such files"
        )
    files = source_files(path)
    check_not_empty(files)
    try:
        with _quiet_load():
            if path.is_dir():
                data = load_dataset(str(path), split="train")
            else:
                data = load_dataset(builder, data_files=str(path), split="train")
    except (DatasetGenerationError, StopIteration, ValueError) as e:  # ValueError: its pandas fallback for JSON
        raise explain_load_error(files, text_field or "", e) from e
    if text_field is not None:
        check_text_column(data, text_field, files)
    return data


def load_from_hub(hub_id: str, hub_config: str | None, split: str = "train") -> IterableDataset:
    logger.info("streaming %s (config %s, split %s) from the Hugging Face hub", hub_id, hub_config, split)
    return load_dataset(hub_id, name=hub_config, split=split, streaming=True)


def load_text_dataset(dataset_name: str, dataset_path: str | None) -> tuple[HFDataset, str]:
    """Resolve a registered name (and optional path override) to a HF dataset and its text field.

    Raises:
        ValueError: unknown name, or unsupported file type.
        FileNotFoundError: a local path (given, or the dataset's local default) does not exist.
    """
    spec = get_spec(dataset_name)
    if dataset_path is not None:
        path = Path(dataset_path).expanduser()
        if path.exists():
            return load_local(path, spec.text_field), spec.text_field
        if spec.hub_id is not None and looks_like_hub_id(dataset_path):
            return load_from_hub(dataset_path, spec.hub_config, spec.hub_split), spec.text_field
        raise FileNotFoundError(
            f"dataset_path {dataset_path!r} for dataset {dataset_name!r} does not exist; pass an existing "
            f".json/.jsonl/.parquet/.txt file or folder" + (" or a hub id 'owner/name'" if spec.hub_id else "")
        )
    if spec.default_path is not None:
        if not spec.default_path.exists():
            raise FileNotFoundError(
                f"dataset {dataset_name!r} reads local data at {str(spec.default_path)!r}, which does not exist; "
                f"create it or set dataset_path to a local copy"
            )
        return load_local(spec.default_path, spec.text_field), spec.text_field
    assert spec.hub_id is not None, f"registry entry {dataset_name!r} has neither a hub id nor a local path"
    return load_from_hub(spec.hub_id, spec.hub_config, spec.hub_split), spec.text_field
