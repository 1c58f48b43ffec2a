"""Where a user's file fails to parse, in one line: the file, the line (or row, or part), what the parser said and
the fix. Every parse of a user's file (a TOML or JSON config, a JSONL row, a safetensors header, a tokenizer file, an
image) goes through ``parsing``. Imports only the standard library and config/errors.py, so any layer can use it."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator

from torchtitan.config.errors import ConfigError


class FileFormatError(ConfigError):
    """A user's file that does not parse (a TOML or JSON config, a JSONL row, a safetensors header, a tokenizer file,
    an image): the message names the file, the line (or row, or part) and what the parser said."""


# "... (at line 3, column 6)" (tomllib before Python 3.14), "... at line 17 column 11" (serde_json, through the
# tokenizers library), "... line 1 column 40 (char 39)" (json's own message)
_WHERE = re.compile(r"^(?P<msg>.*?)[ (]*(?:at )?line (?P<line>\d+),? column (?P<column>\d+)(?: \(char \d+\))?\)?$")


def _parse_errors() -> tuple[type[BaseException], ...]:
    """The standard parsers' errors: JSON, TOML, a text file that is not UTF-8."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib
    return json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError


def describe_parse_error(
    path: str | os.PathLike, error: BaseException, what: str, *, line: int | None = None, part: str = "", fix: str = ""
) -> str:
    """``{path}: line L, column C: not {what} ({the parser's words}); {fix}``.

    ``line``: the file's line of a row parsed alone (a JSONL row), which the message names.
    ``part``: where in the file when it has no lines (a safetensors ``header``).
    """
    found = _WHERE.match(str(error))
    if isinstance(error, json.JSONDecodeError):
        at, column, message = error.lineno, error.colno, error.msg
    elif isinstance(error, UnicodeDecodeError):
        at, column, message = None, None, f"byte {error.start} is not UTF-8"
    elif found is not None:
        at, column, message = int(found["line"]), int(found["column"]), found["msg"]
    else:
        at, column, message = None, None, str(error)
    if line is not None:  # one row: its line (what the parser saw past it is the row's end of line)
        at, column = line, column if at in (None, 1) else None
    where = f"line {at}" + (f", column {column}" if column else "") if at is not None else part
    head = f"{path}: {where}: " if where else f"{path}: "
    return f"{head}not {what} ({message or type(error).__name__})" + (f"; {fix}" if fix else "")


@contextlib.contextmanager
def parsing(
    path: str | os.PathLike,
    what: str,
    *,
    line: int | None = None,
    part: str = "",
    fix: str = "",
    errors: tuple[type[BaseException], ...] = (),
) -> Iterator[None]:
    """Around the parse of a user's file: a JSON, TOML or UTF-8 error (and ``errors``: a library's own, e.g.
    safetensors' or the tokenizers library's) becomes one ``FileFormatError`` line naming the file, the line or
    ``part``, ``what`` the file should be and ``fix`` (``describe_parse_error``). Put only the parse inside."""
    try:
        yield
    except (*_parse_errors(), *errors) as e:
        raise FileFormatError(describe_parse_error(path, e, what, line=line, part=part, fix=fix)) from None
