"""``custom_dataset`` of a task YAML whose ``data_files`` are relative to the YAML's own folder.

lm-eval hands ``dataset_kwargs`` to ``datasets.load_dataset(dataset_path, ...)``, which reads a relative
``data_files`` path against the working directory: a task shipped inside the package (or kept beside its
data) would then load only from one folder. Copy this file beside your YAML to get the same behaviour.
"""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))


def load_json(data_files: dict[str, str] | str, **_metadata):
    """``datasets.load_dataset("json", data_files=...)`` with each relative path read beside this file."""
    import datasets

    def resolve(path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(HERE, path)

    if isinstance(data_files, str):
        files = resolve(data_files)
    else:
        files = {split: resolve(path) for split, path in data_files.items()}
    return datasets.load_dataset("json", data_files=files)
