"""The column names a fine-tuning row's fields are read from (``training.dataset_columns``). Light: the
preflight parses the key with it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ColumnMap:
    """The columns a row's fields are read from (defaults: the chat and prompt/completion shapes' names)."""

    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"
    role: str = "role"
    content: str = "content"
    images: str = "images"  # image-text rows: the list of image files (docs/vision.md)


def parse_columns(pairs: list[str] | None, key: str = "training.dataset_columns") -> ColumnMap:
    """``["messages=conversations", "role=from"]`` -> the ColumnMap (the other fields default).

    Raises:
        ValueError: an entry that is not ``field=column`` or names an unknown field.
    """
    fields = ColumnMap.__dataclass_fields__
    mapping = {}
    for pair in pairs or []:
        name, sep, column = pair.partition("=")
        if not sep or name.strip() not in fields or not column.strip():
            raise ValueError(
                f"{key}: got {pair!r}; each entry is field=column with field one of {', '.join(fields)} "
                "(e.g. 'messages=conversations')"
            )
        mapping[name.strip()] = column.strip()
    return ColumnMap(**mapping)
