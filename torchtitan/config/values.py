"""Config values: check a TOML value, or parse a command-line string, as a schema field's type.

A leaf of config/ (the parser and the translation of torchtitan's 2025 spellings both use it).
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from torchtitan.config.errors import ConfigError

TRUE = {"true", "1", "yes", "on"}
FALSE = {"false", "0", "no", "off"}


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        if _is_table_list(tp):
            return "list of tables ([[section.key]] in TOML; a TOML inline array on the CLI)"
        item = (typing.get_args(tp) or (str,))[0]
        return f"list[{getattr(item, '__name__', item)}] (comma-separated on the CLI)"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def coerce(key: str, value: Any, tp: Any, *, from_cli: bool) -> Any:
    """Check (TOML) or parse (CLI string) ``value`` as type ``tp``; raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (from_cli and str(value).lower() in ("none", "null")):
            if type(None) in args:
                return None
        return coerce(key, value, next(a for a in args if a is not type(None)), from_cli=from_cli)
    try:
        return _coerce_plain(value, tp, from_cli)
    except (TypeError, ValueError):
        raise ConfigError(
            f"config key '{key}': got {value!r} ({type(value).__name__}), expected {type_name(tp)}"
        ) from None


def _coerce_plain(value: Any, tp: Any, from_cli: bool) -> Any:
    if typing.get_origin(tp) is Literal:
        if value not in typing.get_args(tp):
            raise ValueError
        return value
    if _is_table_list(tp):
        if from_cli or isinstance(value, str):
            value = _inline_toml(str(value))
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise TypeError
        return [dict(v) for v in value]
    if typing.get_origin(tp) is list:
        item = (typing.get_args(tp) or (str,))[0]  # list[int] (rl.stop_ids) parses its items as ints
        if from_cli or isinstance(value, str):
            return [_coerce_plain(v.strip(), item, True) for v in str(value).split(",") if v.strip()]
        if not isinstance(value, list):
            raise TypeError
        return [_coerce_plain(v, item, False) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in TRUE | FALSE:
            return str(value).lower() in TRUE
        raise TypeError
    if tp is int:
        if from_cli:
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError
        return value
    if tp is float:
        if from_cli:
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError
        return float(value)
    if tp is str:
        # A bare number in TOML for a string key (e.g. selective_ac_option = 2) is unambiguous.
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
        raise TypeError
    raise TypeError(f"unsupported config field type {tp}")


def _is_table_list(tp: Any) -> bool:
    """``list[dict[...]]``: an array of tables (``[[optimizer.param_groups]]``)."""
    args = typing.get_args(tp)
    return typing.get_origin(tp) is list and bool(args) and typing.get_origin(args[0]) is dict


def _inline_toml(text: str) -> Any:
    """A command-line value written as a TOML value (``[{pattern = "norm", weight_decay = 0.0}]``)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ValueError from None


def toml_value(v: Any) -> str:
    """``v`` as TOML writes it (messages and the dumped config)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'
