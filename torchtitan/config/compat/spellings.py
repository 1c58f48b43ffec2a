"""Keys of another schema (torchtitan's 2025 one) read as this schema's: the rule kinds and the translation.

Each foreign key has one rule (the table: config/compat/keys_2025.py):

* ``Alias(target, convert, implies)``: the same setting under this schema's key ``target``, the value
  converted where the spellings differ (``disable_x`` -> ``enable_x = not x``); ``implies`` sets other keys
  the spelling stands for (a ``[lr_scheduler]`` key means torchtitan 2025's schedule).
* ``Fixed(value, why, also)``: no key here; accepted only as ``value`` (or one of ``also``), which is what
  this trainer does; any other value is refused with ``why`` (NotImplementedError).
* ``Inert(default, converter, why)``: a key that acts upstream only when ``model.converters`` names
  ``converter``, a converter refused here (``why``); so any value loads and has no effect, as upstream's
  does without that converter (a value other than ``default`` is logged as such).
* ``Deferred(default, what)``: read after every source is in (it depends on other keys or the world size).

``translate`` runs once per source (the TOML file, then the command line), so a later source overrides
an earlier one whatever spelling either uses; within one source, two spellings of one key must agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.config.values import coerce, toml_value, type_name


@dataclass(frozen=True)
class Alias:
    target: str
    convert: Callable[[Any], Any] | None = None  # foreign value -> ours; may raise ConfigError / NotImplementedError
    tp: Any = None  # the foreign key's type when it differs from the target's; "raw" = checked by convert
    implies: tuple[tuple[str, Any], ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Fixed:
    tp: Any
    value: Any
    why: str
    also: tuple[Any, ...] = ()  # other values that mean what this trainer does

    def accepts(self, value: Any) -> bool:
        return value == self.value or value in self.also


@dataclass(frozen=True)
class Inert:
    tp: Any
    default: Any
    converter: str
    why: str


@dataclass(frozen=True)
class Deferred:
    tp: Any
    default: Any
    what: str


Rule = Alias | Fixed | Deferred | Inert
FieldType = Callable[[str], Any]  # canonical key -> its type (None: not a key of this schema)


def describe(rule: Rule) -> str:
    """One line for --help and docs/compatibility.md."""
    if isinstance(rule, Alias):
        return rule.note or f"spelling of {rule.target}"
    if isinstance(rule, Fixed):
        shown = " or ".join("unset" if v is None else toml_value(v) for v in (rule.value, *rule.also))
        return f"accepted only as {shown}: {rule.why}"
    if isinstance(rule, Inert):
        return f"no effect unless model.converters names {rule.converter!r}, which is refused: {rule.why}"
    return rule.what


@dataclass
class Given:
    """What the sources gave so far, beyond the values already set on the config."""

    keys: set[str] = field(default_factory=set)  # canonical keys set by some source, under any spelling
    spelled: dict[str, Any] = field(default_factory=dict)  # foreign key -> its value (checked), last source wins
    pending: dict[str, Exception] = field(default_factory=dict)  # target -> refusal a later source may override
    file_keys: list[str] = field(default_factory=list)  # the TOML file's keys as written


def _written(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    if tp == "raw":
        return value
    if value is None and from_cli:  # a bare flag
        if tp is not bool:
            raise ConfigError(f"flag --{key} needs a value ({type_name(tp)})")
        return True
    return coerce(key, value, tp, from_cli=from_cli)


def translate(
    pairs: list[tuple[str, Any]], *, from_cli: bool, rules: dict[str, Rule], field_type: FieldType, given: Given
) -> list[tuple[str, Any, bool]]:
    """One source's pairs -> ``(canonical key, value, value_is_cli_text)`` for ``JobConfig.set``; foreign keys
    without a key here are recorded in ``given.spelled``.

    Raises:
        ConfigError: a foreign value of the wrong type, or two spellings of one key disagreeing.
    """
    out: list[tuple[str, Any, bool]] = []
    spelled: dict[str, tuple[str, Any, Any]] = {}  # target -> (foreign key, value as written, value here)
    direct: dict[str, Any] = {}
    errors: dict[str, Exception] = {}
    for key, value in pairs:
        rule = rules.get(key)
        if rule is None:
            out.append((key, value, from_cli))
            direct[key] = value
            continue
        tp = rule.tp if not isinstance(rule, Alias) or rule.tp is not None else field_type(rule.target)
        written = given.spelled[key] = _written(key, value, tp, from_cli)
        if not isinstance(rule, Alias):
            continue
        try:
            ours = rule.convert(written) if rule.convert is not None else written
        except (ConfigError, NotImplementedError) as e:
            errors[rule.target] = e
            continue
        for target, v in ((rule.target, ours), *rule.implies):
            if target in spelled and spelled[target][2] != v:
                _contradiction(spelled[target][:2], (key, written), target, v)
            spelled[target] = (key, written, v)
            out.append((target, v, False))
    for target, (key, written, ours) in spelled.items():
        if target in direct:
            mine = _written(target, direct[target], field_type(target), from_cli)
            if mine != ours:
                _contradiction((target, mine), (key, written), target, ours)
    set_here = {key for key, _, _ in out}
    for key in set_here:
        given.pending.pop(key, None)
    given.pending.update(errors)
    given.keys |= set_here
    return out


def _contradiction(first: tuple[str, Any], second: tuple[str, Any], target: str, ours: Any) -> None:
    (k1, v1), (k2, v2) = first, second
    raise ConfigError(
        f"{k1} = {toml_value(v1)} and {k2} = {toml_value(v2)} contradict each other ({k2} = {toml_value(v2)} is "
        f"torchtitan 2025's spelling of {target} = {toml_value(ours)}); keep only one of them"
    )
