"""Load the job config: defaults < TOML file < ``--section.key value`` flags; strict about keys and types.

``python -m torchtitan.preflight [--world_size N] ARGS`` checks a config without training (the
launchers run it before starting any process); the checks themselves live beside their features.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import os
import sys
import typing
from collections.abc import Iterator
from typing import Any

from torchtitan.config.as_code import ConfigFunction, call_function, config_table, function_flags
from torchtitan.config.compat.keys_2025 import RULES, SECTIONS_2025
from torchtitan.config.compat.keys_2026 import help_2026
from torchtitan.config.compat.resolve_2025 import resolve
from torchtitan.config.compat.spellings import Alias, Given, describe, translate
from torchtitan.config.errors import ConfigError  # also importable from here, as before
from torchtitan.config.parse_errors import parsing
from torchtitan.config.schema import NEGATED_ALIASES, JobConfigTree
from torchtitan.config.values import coerce, toml_value, type_name

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib


@functools.cache  # the schema is fixed: resolving its annotations took ~0.2 s of every parse
def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfigTree)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfigTree)}


@functools.cache
def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def all_keys() -> list[str]:
    return [f"{s}.{k}" for s, cls in _sections().items() for k in _field_types(cls)]


def _field_type(key: str) -> Any:
    """The type of canonical key ``section.key``, or None when there is no such key."""
    section, _, name = key.partition(".")
    cls = _sections().get(section)
    return None if cls is None else _field_types(cls).get(name)


def _unknown_key_error(key: str) -> ConfigError:
    # this schema's keys first (as before), then torchtitan 2025's; both at once in a section only 2025 has
    if key.partition(".")[0] in SECTIONS_2025:
        close = difflib.get_close_matches(key, [*RULES, *all_keys()], n=1, cutoff=0.6)
    else:
        close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
        close = close or difflib.get_close_matches(key, list(RULES), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else " (run with --help to list the keys)"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _split_cli(argv: list[str]) -> list[tuple[str, str | None]]:
    """``--a.b v`` / ``--a.b=v`` / bare ``--a.b`` (a boolean flag) -> [(key, value-or-None)]."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}': flags look like --section.key value")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")  # torchtitan 2025's CLI (tyro) also spells keys with hyphens
        if eq:
            pairs.append((key, value))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((key, argv[i + 1]))
            i += 1
        else:
            pairs.append((key, None))
        i += 1
    return pairs


def _config_file(cli: list[tuple[str, str | None]]) -> str | None:
    """The one ``--job.config_file`` of the command line (the same file repeated is one); two different ones refused.

    run_llama_train.sh passes CONFIG_FILE only when the user gives no ``--job.config_file`` of their own, so a
    second, different file here is the user's own contradiction, not the script's default.
    """
    files = list(dict.fromkeys(v for k, v in cli if k == "job.config_file"))
    if None in files:
        raise ConfigError(
            "flag --job.config_file needs a value: the TOML file to load, e.g. train_configs/debug_model.toml"
        )
    if len(files) > 1:
        raise ConfigError(
            f"--job.config_file given {len(files)} different files: {', '.join(repr(f) for f in files)}; "
            "pass one (run_llama_train.sh: --job.config_file FILE, or CONFIG_FILE=FILE)"
        )
    return files[0] if files else None


def _is_bool_key(key: str) -> bool:
    rule = RULES.get(key)
    if isinstance(rule, Alias):
        return (rule.tp or _field_type(rule.target)) is bool
    return (rule.tp if rule is not None else _field_type(key)) is bool or key in NEGATED_ALIASES


def _negated_flags(pairs: list[tuple[str, str | None]]) -> list[tuple[str, str | None]]:
    """torchtitan 2025's bare ``--section.no_key`` (tyro's spelling of ``key = false``) -> ``(section.key, "false")``."""
    out = []
    for key, value in pairs:
        section, _, name = key.partition(".")
        plain = f"{section}.{name.removeprefix('no_')}"
        if value is None and name.startswith("no_") and not _is_bool_key(key) and _is_bool_key(plain):
            key, value = plain, "false"
        out.append((key, value))
    return out


def _toml_pairs(data: dict[str, Any]) -> list[tuple[str, Any]]:
    """A parsed TOML file -> [(section.key, value)], in file order; nested tables (torchtitan 2025's
    ``[quantize.linear.float8]``) give dotted keys."""
    pairs = []
    for section, values in data.items():
        if not isinstance(values, dict):
            raise (
                _unknown_key_error(section)
                if section not in _sections()
                else ConfigError(f"config section '[{section}]' must be a table of keys, got {values!r}")
            )
        pairs += _flatten(section, values)
    return pairs


def _flatten(prefix: str, values: dict[str, Any]) -> list[tuple[str, Any]]:
    pairs = []
    for key, value in values.items():
        full = f"{prefix}.{key}"
        pairs += _flatten(full, value) if isinstance(value, dict) else [(full, value)]
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
                    f"{spelling} = {toml_value(earlier_written)} and {key} = {toml_value(written)} contradict each "
                    f"other ({alias} is the older spelling of {canonical} = false); keep only {canonical}"
                )
            seen[canonical] = (key, written, value)
        out.append((canonical, value))
    return out


@contextlib.contextmanager
def _naming(where: str | None) -> Iterator[None]:
    """A ConfigError raised inside names ``where`` (the function whose values are being read) first."""
    try:
        yield
    except ConfigError as e:
        if where is None:
            raise
        raise ConfigError(f"{where}: {e}") from None


def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f, parsing(path, "valid TOML", fix="fix that line"):
            return tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"config file not found: '{path}' (set --job.config_file to an existing TOML)"
        ) from None


class JobConfig(JobConfigTree):
    """The resolved config of one run. Build with ``JobConfig.parse_args(argv)``."""

    built_by: ConfigFunction | None = None
    """The function that built this config (``--module M --config F``), as the run records it; None: a TOML or the
    defaults. Not a config value: the dumped config.toml holds the values, not where they came from."""

    @classmethod
    def parse_args(cls, argv: list[str] | None = None, *, world_size: int | None = None) -> JobConfig:
        """Defaults < the TOML file (or the function of ``--module M --config F``) < the flags, in this schema's keys
        or torchtitan 2025's (config/compat/keys_2025.py).

        ``world_size``: the number of processes of the run; only ``training.global_batch_size`` (2025) needs it,
        to find the data-parallel degree when ``data_parallel_shard_degree = -1``.
        """
        argv = list(sys.argv[1:] if argv is None else argv)
        function, cli = function_flags(_negated_flags(_split_cli(argv)))
        config = cls()
        given = Given()
        config_file = _config_file(cli)
        base = config._base_pairs(config_file, function)
        given.file_keys = [key for key, _ in base]
        where = config.built_by.describe() if config.built_by else None
        for pairs, from_cli, named in ((base, False, where), (cli, True, None)):
            with _naming(named):
                pairs = _resolve_aliases(pairs, from_cli=from_cli)
                for key, value, as_text in translate(
                    pairs, from_cli=from_cli, rules=RULES, field_type=_field_type, given=given
                ):
                    config.set(key, value, from_cli=as_text)
        resolve(config, given, world_size=world_size, config_file=config_file or where)
        if config.optimizer.state_dtype is None:  # the moments follow the parameters unless set
            config.optimizer.state_dtype = config.training.dtype
        return config

    def _base_pairs(self, config_file: str | None, function: tuple[str, str] | None) -> list[tuple[str, Any]]:
        """What the flags apply on top of, as (key, value) pairs: the TOML file's, or the values of the function
        ``--module M --config F`` returned (config/as_code.py; then ``built_by`` names it), or none."""
        if config_file is not None and function is not None:
            raise ConfigError(
                f"--module {function[0]} --config {function[1]} and --job.config_file {config_file} both given: pick "
                "one (run_llama_train.sh: MODULE=M CONFIG=F, or CONFIG_FILE=FILE)"
            )
        if config_file is not None:
            return _toml_pairs(load_toml(config_file))
        if function is None:
            return []
        built, self.built_by = call_function(*function)
        table = config_table(built, type(self), self.built_by, records=("built_by",))
        if isinstance(built, type(self)) and table.get("optimizer", {}).get("state_dtype") == built.training.dtype:
            del table["optimizer"]["state_dtype"]  # the moments following the parameters (parse_args): unset
        with _naming(self.built_by.describe()):  # an attribute that is no section: an unknown key
            return _toml_pairs(table)

    def set(self, dotted_key: str, value: Any, *, from_cli: bool) -> None:
        """Set one canonical key; ``from_cli`` values are strings to parse, others are checked as they are."""
        section, _, key = dotted_key.partition(".")
        sections = _sections()
        if section not in sections or key not in _field_types(sections[section]):
            raise _unknown_key_error(dotted_key)
        tp = _field_types(sections[section])[key]
        if value is None and from_cli:  # a bare flag
            if tp is not bool:
                raise ConfigError(f"flag --{dotted_key} needs a value ({type_name(tp)})")
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


def dump_toml(data: dict[str, dict[str, Any]]) -> str:
    """Write the config tree as TOML (None values are omitted: absent means None)."""
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items() if v is not None]
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


def print_help(*texts: str) -> None:
    """Print ``--help``'s text; a reader that stops early (``--help | head``) is no error: no traceback."""
    try:
        for text in texts:
            print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's final flush must not fail


def format_help() -> str:
    defaults = JobConfigTree()
    alias_of = {canonical: alias for alias, canonical in NEGATED_ALIASES.items()}
    spelled_as: dict[str, list[tuple[str, Alias]]] = {}
    for key, rule in RULES.items():
        if isinstance(rule, Alias):
            spelled_as.setdefault(rule.target, []).append((key, rule))
    out = [
        "usage: python -m torchtitan.train [--job.config_file FILE | --module M --config F] [--section.key VALUE ...]",
        "",
        "Precedence: defaults < TOML file (or function) < command-line flags. A boolean key may be a bare flag.",
        "--module M --config F: the config is what function F of module M returns (a JobConfig: from torchtitan.config",
        "  import JobConfig), read as a TOML file's values are; M is a dotted module importable from the current",
        "  directory or installed (train_configs.recipes), or a .py file. Not with --job.config_file: pick one.",
    ]
    for section, cls in _sections().items():
        out += ["", f"[{section}]"]
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            tp = type_name(_field_types(cls)[f.name])
            out.append(f"  --{section}.{f.name} ({tp}, default {default!r}{_limits(f)})")
            out.append(f"      {f.metadata.get('help', '')}")
            if f"{section}.{f.name}" in alias_of:
                out.append(f"  --{alias_of[f'{section}.{f.name}']} (bool, deprecated)")
                out.append(
                    f"      older spelling of {section}.{f.name} = false, mapped onto it when parsed "
                    "(giving both with opposite meanings is an error)"
                )
            for spelling, rule in spelled_as.get(f"{section}.{f.name}", []):
                out.append(f"  --{spelling} (torchtitan 2025): {describe(rule)}")
    return "\n".join(out + _help_2025_only() + help_2026())


def _help_2025_only() -> list[str]:
    """torchtitan 2025's keys with no key of their own here (docs/compatibility.md, the 2025 table)."""
    out = [
        "",
        "[torchtitan 2025 keys without a key here] (TOML tables such as [quantize.linear.float8] give dotted keys;",
        " --section.key-name and a bare --section.no_key = false are accepted as torchtitan 2025 spells them)",
    ]
    for key, rule in RULES.items():
        if not isinstance(rule, Alias):
            out.append(f"  --{key}: {describe(rule)}")
    return out


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


if __name__ == "__main__":  # the check moved; fail rather than exit 0 without checking anything
    sys.exit("the config check is now: python -m torchtitan.preflight [--world_size N] ARGS")
