"""The schema's field helper: a dataclass field carrying its ``--help`` text and check metadata."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from torchtitan.config.bounds import Bound

POSITIVE = Bound(ge=1)


def config_field(
    default: Any,
    help: str,
    *,
    bound: Bound | None = None,
    choices: tuple[Any, ...] | None = None,
    not_built: str | None = None,
) -> Any:
    """A dataclass field with a help string and, for ``--help`` and the range check (config/bounds.py), its
    numeric ``bound``, its allowed ``choices`` (a str key that is not a Literal), or the feature it would turn on
    that is ``not_built`` yet. A list default gets its own copy per instance."""
    metadata = {"help": help, "bound": bound, "choices": choices, "not_built": not_built}
    metadata = {k: v for k, v in metadata.items() if v is not None}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)
