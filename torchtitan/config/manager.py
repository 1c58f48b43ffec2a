"""Load the job config: defaults < TOML file < ``--section.key value`` flags; strict about keys and types.

``python -m torchtitan.preflight [--world_size N] ARGS`` checks a config without training (the
launchers run it before starting any process); the checks themselves live beside their features.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from typing import Any, Literal

from torchtitan.config.errors import ConfigError  # also importable from here, as before
from torchtitan.config.schema import NEGATED_ALIASES, JobConfigTree

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfigTree)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfigTree)}


def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def all_keys() -> list[str]:
    return [f"{s}.{k}" for s, cls in _sections().items() for k in _field_types(cls)]


def _unknown_key_error(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else " (run with --help to list the keys)"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return "list[str] (comma-separated on the CLI)"
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
            f"config key '{key}': got {value!r} ({type(value).__name__}), expected {_type_name(tp)}"
        ) from None


def _coerce_plain(value: Any, tp: Any, from_cli: bool) -> Any:
    if typing.get_origin(tp) is Literal:
        if value not in typing.get_args(tp):
            raise ValueError
        return value
    if typing.get_origin(tp) is list:
        if from_cli or isinstance(value, str):
            return [v.strip() for v in str(value).split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise TypeError
        return list(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
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


def _split_cli(argv: list[str]) -> list[tuple[str, str | None]]:
    """``--a.b v`` / ``--a.b=v`` / bare ``--a.b`` (a boolean flag) -> [(key, value-or-None)]."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}': flags look like --section.key value")
        key, eq, value = arg[2:].partition("=")
        if eq:
            pairs.append((key, value))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((key, argv[i + 1]))
            i += 1
        else:
            pairs.append((key, None))
        i += 1
    return pairs


def _toml_pairs(data: dict[str, Any]) -> list[tuple[str, Any]]:
    """A parsed TOML file -> [(section.key, value)], in file order."""
    pairs = []
    for section, values in data.items():
        if not isinstance(values, dict):
            raise (
                _unknown_key_error(section)
                if section not in _sections()
                else ConfigError(f"config section '[{section}]' must be a table of keys, got {values!r}")
            )
        pairs += [(f"{section}.{key}", value) for key, value in values.items()]
    return pairs


def _resolve_aliases(pairs: list[tuple[str, Any]], *, from_cli: bool) -> list[tuple[str, Any]]:
    """Map each deprecated ``disable_x`` key onto its canonical ``enable_x = not value``.

    ``pairs`` come from one source (the TOML file or the command line); a later source still
    overrides an earlier one. Raises ConfigError when one source gives both spellings of a key
    with opposite meanings.
    """
    canonical_keys = set(NEGATED_ALIASES.values())
    seen: dict[str, tuple[str, bool, bool]] = {}  # canonical key -> (spelling, value as written, effective value)
    out = []
    for key, value in pairs:
        canonical = NEGATED_ALIASES.get(key, key)
        if canonical in canonical_keys:
            written = True if value is None and from_cli else coerce(key, value, bool, from_cli=from_cli)
            value = written if key == canonical else not written
            spelling, earlier_written, earlier = seen.get(canonical, (key, written, value))
            if spelling != key and earlier != value:
                alias = key if key != canonical else spelling
                raise ConfigError(
                    f"{spelling} = {_toml_value(earlier_written)} and {key} = {_toml_value(written)} contradict each "
                    f"other ({alias} is the older spelling of {canonical} = false); keep only {canonical}"
                )
            seen[canonical] = (key, written, value)
        out.append((canonical, value))
    return out


def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"config file not found: '{path}' (set --job.config_file to an existing TOML)"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from None


class JobConfig(JobConfigTree):
    """The resolved config of one run. Build with ``JobConfig.parse_args(argv)``."""

    @classmethod
    def parse_args(cls, argv: list[str] | None = None) -> JobConfig:
        argv = list(sys.argv[1:] if argv is None else argv)
        cli = _split_cli(argv)
        config = cls()
        config_file = next((v for k, v in cli if k == "job.config_file"), None)
        if config_file is not None:
            for key, value in _resolve_aliases(_toml_pairs(load_toml(config_file)), from_cli=False):
                config.set(key, value, from_cli=False)
        for key, value in _resolve_aliases(cli, from_cli=True):
            config.set(key, value, from_cli=True)
        return config

    def set(self, dotted_key: str, value: Any, *, from_cli: bool) -> None:
        """Set one canonical key; ``from_cli`` values are strings to parse, others are checked as they are."""
        section, _, key = dotted_key.partition(".")
        sections = _sections()
        if section not in sections or key not in _field_types(sections[section]):
            raise _unknown_key_error(dotted_key)
        tp = _field_types(sections[section])[key]
        if value is None and from_cli:  # a bare flag
            if tp is not bool:
                raise ConfigError(f"flag --{dotted_key} needs a value ({_type_name(tp)})")
            value = "true"
        setattr(getattr(self, section), key, coerce(dotted_key, value, tp, from_cli=from_cli))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {s: dataclasses.asdict(getattr(self, s)) for s in _sections()}

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())

    @property
    def loss_parallel(self) -> bool:
        """Whether loss parallel is asked for (it takes effect only with TP; see ParallelDims)."""
        return self.training.enable_loss_parallel


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def dump_toml(data: dict[str, dict[str, Any]]) -> str:
    """Write the config tree as TOML (None values are omitted: absent means None)."""
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    return "\n".join(lines)


def _limits(f: dataclasses.Field) -> str:
    """The field's range or allowed values as ``--help`` shows them (config/bounds.py checks them)."""
    out = ""
    if "bound" in f.metadata:
        out += f", {f.metadata['bound'].describe()}"
    if "choices" in f.metadata:
        out += f", one of {', '.join(f.metadata['choices'])}"
    if "not_built" in f.metadata:
        out += ", not built yet: only the default is accepted"
    return out


def format_help() -> str:
    defaults = JobConfigTree()
    alias_of = {canonical: alias for alias, canonical in NEGATED_ALIASES.items()}
    out = [
        "usage: python -m torchtitan.train [--job.config_file FILE] [--section.key VALUE ...]",
        "",
        "Precedence: defaults < TOML file < command-line flags. A boolean key may be given as a bare flag.",
    ]
    for section, cls in _sections().items():
        out += ["", f"[{section}]"]
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            tp = _type_name(_field_types(cls)[f.name])
            out.append(f"  --{section}.{f.name} ({tp}, default {default!r}{_limits(f)})")
            out.append(f"      {f.metadata.get('help', '')}")
            if f"{section}.{f.name}" in alias_of:
                out.append(f"  --{alias_of[f'{section}.{f.name}']} (bool, deprecated)")
                out.append(
                    f"      older spelling of {section}.{f.name} = false, mapped onto it when parsed "
                    "(giving both with opposite meanings is an error)"
                )
    return "\n".join(out)


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


if __name__ == "__main__":  # the check moved; fail rather than exit 0 without checking anything
    sys.exit("the config check is now: python -m torchtitan.preflight [--world_size N] ARGS")
