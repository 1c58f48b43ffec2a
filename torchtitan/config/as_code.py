"""Configurations as code: ``--module M --config F``, a Python function ``F`` of module ``M`` that returns a JobConfig.

The function's config enters the parser where a TOML file's would, as the same ``[section] key = value`` tables
(``config_table``: its values that differ from a default JobConfig), so one path checks both: unknown keys (an
attribute JobConfig does not have included), types, torchtitan 2025's spellings, then the flags on top and the
ranges before launch. ``M`` is a dotted module name, imported from the current directory or the installed
packages, or a ``.py`` file. Every error is one line naming the module and the function. It imports the user's
module by name at run time, and of the package only config/.

Upstream torchtitan's 2026 recipes (``--module torchtitan_recipes.tests.features --config F``, its package copied
unchanged) run too: while such a module is imported and called, upstream's module names resolve to the stand-ins
of config/compat/upstream_2026, and the ``Trainer.Config`` it returns is the other branch of ``config_table``,
read by the rules of config/compat/keys_2026.py (docs/compatibility.md, "2026 configurations").
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torchtitan.config.compat.read_2026 import config_table_2026
from torchtitan.config.compat.upstream_2026 import TrainerConfig, aliased, is_upstream_recipe
from torchtitan.config.errors import ConfigError

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
USAGE = (
    "--module M --config F (F a function of module M returning a JobConfig; M dotted, or a path/to/file.py; "
    "run_llama_train.sh: MODULE=M CONFIG=F)"
)


@dataclass(frozen=True)
class ConfigFunction:
    """The function that built a run's config, as the run records it (run_info.json, command.txt)."""

    module: str  # as given: a dotted name or a file path
    function: str
    file: str | None = None  # the module's file, absolute; None for one without a file
    sha256: str | None = None  # of that file's bytes when it was imported

    def describe(self) -> str:
        return f"{self.function}() of {self.module}"


def function_flags(cli: list[tuple[str, str | None]]) -> tuple[tuple[str, str] | None, list[tuple[str, str | None]]]:
    """``--module M --config F`` out of the command line's pairs -> ((M, F) or None, the other pairs).

    Raises:
        ConfigError: a flag without a value, one of the two without the other, or one given twice differently.
    """
    rest = [(k, v) for k, v in cli if k not in ("module", "config")]
    given = {}
    for flag in ("module", "config"):
        values = list(dict.fromkeys(v for k, v in cli if k == flag))
        if None in values:
            raise ConfigError(f"flag --{flag} needs a value: {USAGE}")
        if len(values) > 1:
            raise ConfigError(
                f"--{flag} given {len(values)} different values: {', '.join(map(repr, values))}; pass one"
            )
        given[flag] = values[0] if values else None
    if given["module"] is None and given["config"] is None:
        return None, rest
    for flag, other in (("module", "config"), ("config", "module")):
        if given[other] is None:
            raise ConfigError(f"--{flag} {given[flag]} needs --{other} too: {USAGE}")
    return (given["module"], given["config"]), rest


def _where(error: BaseException, file: str | None) -> str:
    """`` (FILE, line N)`` of the innermost frame of ``error`` in ``file`` (else its innermost frame)."""
    if isinstance(error, SyntaxError) and error.filename:
        return f" ({error.filename}, line {error.lineno})"
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if file is not None and os.path.abspath(f.filename) == file] or frames[-1:]
    return f" ({mine[-1].filename}, line {mine[-1].lineno})" if mine else ""


def _said(error: BaseException) -> str:
    """``Type: message`` on one line (a SyntaxError's without its place, which ``_where`` gives)."""
    text = " ".join(str(error.msg if isinstance(error, SyntaxError) else error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _import_file(path: str) -> ModuleType:
    if not os.path.isfile(path):
        raise ConfigError(f"--module {path}: no such file (a module is a dotted name, or a .py file that exists)")
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    registered = name not in sys.modules  # dataclasses in the file look their module up by name
    if registered:
        sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if registered:
            del sys.modules[name]
        raise
    return module


def _import_dotted(name: str) -> ModuleType:
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path  # `python -m` puts the current directory first; a script not
    if added:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # a module written since the last import (a test's) is found
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise ConfigError(
                f"--module {name}: no such module in the current directory ({cwd}) or the installed packages; give "
                "a dotted module name importable from here, or a file: --module path/to/recipes.py"
            ) from None
        raise
    finally:
        if added:
            sys.path.remove(cwd)


def import_module(module: str) -> ModuleType:
    """``module``: a dotted name or a ``.py`` file.

    Raises:
        ConfigError: no such module, not a module name, or importing it raised (named with its file and line).
    """
    as_file = module.endswith(".py") or os.sep in module or "/" in module
    if not as_file and not _DOTTED.fullmatch(module):
        raise ConfigError(
            f"--module {module!r}: not a module: give a dotted name (train_configs.recipes) or a .py file"
        )
    file = os.path.abspath(module) if as_file else None
    try:
        return _import_file(module) if as_file else _import_dotted(module)
    except ConfigError:
        raise
    except Exception as e:
        if file is None and (spec := importlib.util.find_spec(module.partition(".")[0])) is not None:
            file = spec.origin
        raise ConfigError(f"--module {module}: importing it raised {_said(e)}{_where(e, file)}") from None


def _functions(module: ModuleType) -> list[str]:
    """The public functions that ``module`` defines (not those it imports)."""
    return sorted(
        n
        for n, v in vars(module).items()
        if inspect.isfunction(v) and not n.startswith("_") and v.__module__ == module.__name__
    )


def _file_record(module: ModuleType) -> tuple[str | None, str | None]:
    file = getattr(module, "__file__", None)
    if file is None or not os.path.isfile(file):
        return None, None
    with open(file, "rb") as f:
        return os.path.abspath(file), hashlib.sha256(f.read()).hexdigest()


def call_function(module_name: str, function: str) -> tuple[Any, ConfigFunction]:
    """Import ``module_name``, call its ``function()`` -> (what it returned, the record of the function).

    Raises:
        ConfigError: any failure on the way, in one line naming the module and the function.
    """
    with aliased(is_upstream_recipe(module_name)):
        return _call_function(module_name, function)


def _call_function(module_name: str, function: str) -> tuple[Any, ConfigFunction]:
    module = import_module(module_name)
    file, sha256 = _file_record(module)
    source = ConfigFunction(module_name, function, file, sha256)
    shown = f"{module_name} ({os.path.relpath(file)})" if file else module_name
    fn = getattr(module, function, None)
    if fn is None:
        names = _functions(module)
        close = difflib.get_close_matches(function, names, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"--config {function}: {shown} has no function '{function}'{hint}; its functions: "
            f"{', '.join(names) or 'none'}"
        )
    if not callable(fn):
        raise ConfigError(f"--config {function}: '{function}' of {shown} is {_a(fn)}, not a function")
    try:
        return fn(), source
    except Exception as e:
        raise ConfigError(f"{source.describe()} raised {_said(e)}{_where(e, file)}") from None


def _a(value: Any) -> str:
    """``a dict ({'training': ...})``: what a value is, briefly."""
    if value is None:
        return "None (a missing `return config`?)"
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    kind = type(value).__name__
    return f"{'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind} ({text})"


def config_table(config: Any, expected: type, source: ConfigFunction, *, records: tuple[str, ...]) -> dict[str, Any]:
    """The values of ``config`` (what ``source`` returned) that differ from a default ``expected()``, as the tables
    of a parsed TOML file: ``{section: {key: value}}``. An attribute that is no field is kept, for the parser to
    refuse as an unknown key; ``records`` name attributes that are no config values (``JobConfig.built_by``).
    An upstream 2026 ``Trainer.Config``: every field, read onto our keys by keys_2026's rules.

    Raises:
        ConfigError: ``config`` is not an ``expected``, or one of its sections is not its section's class.
        NotImplementedError: an upstream 2026 field at a value not built here.
    """
    if isinstance(config, TrainerConfig):
        return config_table_2026(config, source.describe())
    if not isinstance(config, expected):
        raise ConfigError(
            f"{source.describe()} returned {_a(config)}, expected a {expected.__name__}: start from "
            f"`config = {expected.__name__}()` (from torchtitan.config import {expected.__name__}), set its fields "
            "and return it"
        )
    defaults = expected()
    table: dict[str, Any] = {}
    for name, value in vars(config).items():
        default = getattr(defaults, name, None)
        if name in records:
            continue
        if dataclasses.is_dataclass(default) and type(value) is not type(default):
            raise ConfigError(
                f"{source.describe()}: config.{name} is {_a(value)}, expected a {type(default).__name__} "
                f"(set its fields: config.{name}.KEY = VALUE)"
            )
        if dataclasses.is_dataclass(default):
            given = {k: v for k, v in vars(value).items() if k not in vars(default) or vars(default)[k] != v}
            if given:
                table[name] = given
        elif name not in vars(defaults) or value != default:
            table[name] = value
    return table
