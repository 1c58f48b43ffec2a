"""Numeric ranges and unavailable keys, as schema field metadata: ``--help`` prints them and
``check_ranges`` / ``check_not_built`` enforce them (the first checks of the pre-launch preflight).

A leaf like the rest of config/: it knows the fields, not the features behind them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from torchtitan.config.errors import ConfigError


@dataclass(frozen=True)
class Bound:
    """A numeric range of one field: ``>= ge`` and/or ``> gt``, and ``<= le``; None values pass (an unset optional key).

    ``text`` replaces the generated ``>= ge`` in messages and ``--help``; it may name the section's other
    fields as ``{field}`` (``checkpoint.interval``'s unit is ``{interval_type}``).
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    text: str | None = None

    def allows(self, value: float | None) -> bool:
        if value is None:
            return True
        lower = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        return lower and (self.le is None or value <= self.le)

    def describe(self, section: Any = None) -> str:
        if self.text is not None:
            # --help has no values: ``{interval_type}`` reads as the field's name there.
            return self.text.format(**vars(section)) if section is not None else re.sub(r"\{(\w+)\}", r"\1", self.text)
        parts = ([f">= {self.ge}"] if self.ge is not None else []) + ([f"> {self.gt}"] if self.gt is not None else [])
        parts += [f"<= {self.le}"] if self.le is not None else []
        return " and ".join(parts)


def _sections(config: Any) -> list[tuple[str, Any]]:
    return [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]


def _fields(config: Any):
    """(section name, section, field, value) of every field of every section, in schema order."""
    for name, section in _sections(config):
        if dataclasses.is_dataclass(section):
            for f in dataclasses.fields(section):
                yield name, section, f, getattr(section, f.name)


def check_ranges(config: Any) -> None:
    """No NaN or infinity in a float key; every ``Bound`` and ``choices`` of the schema holds.

    Raises:
        ConfigError: naming the key, the value and the range.
    """
    for name, _, f, value in _fields(config):
        # ``--optimizer.lr inf`` would pass every range check.
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}.{f.name} must be a finite number, got {value}")
    for name, section, f, value in _fields(config):
        bound: Bound | None = f.metadata.get("bound")
        if bound is not None and not bound.allows(value):
            raise ConfigError(f"{name}.{f.name} must be {bound.describe(section)}, got {value}")
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(f"{name}.{f.name} = {value!r}: allowed are {list(choices)}")


def check_not_built(config: Any) -> None:
    """A key whose feature is not built yet is refused unless it holds its default ("off").

    Raises:
        NotImplementedError: naming the key and the value to set.
    """
    defaults = type(config)()
    for name, _, f, value in _fields(config):
        feature = f.metadata.get("not_built")
        off = getattr(getattr(defaults, name), f.name)
        if feature is not None and value != off:
            key = f"{name}.{f.name}"
            raise NotImplementedError(f"{key} = {value!r}: {feature} is not available yet; set {key} = {off!r}")
