"""Log formatting and the run's log level; only entry points call ``init_logger``.

Third-party output is detail: at the run's ``job.log_level`` of 'debug' it shows as the libraries write it, at
'info' (the default) and above only their errors (``IMPORT_NOTES``, ``third_party_detail``), so the log holds our
lines.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass


def init_logger() -> None:
    """INFO to stderr; idempotent. (torchrun --tee already prefixes each line with its rank.)"""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in list(root.handlers):
        if getattr(handler, "_torchtitan", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    handler._torchtitan = True
    root.addHandler(handler)


# Third-party loggers whose notes at import time are detail: torchao's (optional kernels that did not load, no
# triton) and torch's pytree notes on torchao's enums (register_constant() on an Enum subclass is deprecated); and
# (aio)botocore's on each S3 session a URL checkpoint.folder opens ("Found credentials in environment variables.").
IMPORT_NOTES = ("torchao", "torch.utils._pytree", "botocore", "aiobotocore")


# What importing torchao prints that says nothing about the run (transformers imports it with any of its model classes,
# for its quantizer; float8 and QLoRA import it themselves): its optional kernels' .so files that did not load on this
# machine, "no triton" (a CPU machine), and torch's note that registering torchao's enums as pytree constants is
# deprecated (dropped only when the enum is torchao's: torch says the same of other libraries' classes, theirs to hear).
@dataclass(frozen=True)
class _ImportNote:
    logger: str
    texts: tuple[str, ...]  # a dropped message holds them all
    about_torchao_class: bool = False  # and its first argument is a torchao class


_TORCHAO_IMPORT_NOTES = (
    _ImportNote("torchao", ("Failed to load ", ".so")),
    _ImportNote("torchao.kernel.intmm", ("Detected no triton",)),
    _ImportNote("torch.utils._pytree", ("register_constant()", "deprecated"), about_torchao_class=True),
)


class _DropImportNote(logging.Filter):
    def __init__(self, note: _ImportNote):
        super().__init__()
        self.note = note

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not all(text in message for text in self.note.texts):
            return True
        if self.note.about_torchao_class:
            subject = record.args[0] if isinstance(record.args, tuple) and record.args else None
            return not str(getattr(subject, "__module__", "")).startswith("torchao")
        return False


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Inside, importing torchao (itself or through transformers' model classes) prints none of its import notes
    above (the .so files that did not load, no triton, the pytree deprecation of its enums); anything else those
    loggers say passes, and a run at ``job.log_level = 'debug'`` sees them all (``IMPORT_NOTES``). The one home for
    this: float8's and QLoRA's imports of torchao, and the entry points that import transformers' models before (or
    without) a run's log level (the pre-launch check, scripts/generate.py)."""
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        yield
        return
    filters = [(logging.getLogger(note.logger), _DropImportNote(note)) for note in _TORCHAO_IMPORT_NOTES]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


def quiet_torchao_notes() -> None:
    """``quiet_torchao_import`` for the rest of the process (idempotent): for float8 and QLoRA, whose torchao
    imports are spread over the run (its float8 TP styles, async TP's kernels, NF4), each a first import that may
    register more of torchao's enums."""
    for note in _TORCHAO_IMPORT_NOTES:
        logger = logging.getLogger(note.logger)
        if not any(isinstance(f, _DropImportNote) and f.note == note for f in logger.filters):
            logger.addFilter(_DropImportNote(note))


def set_log_level(level: str) -> None:
    """The run's log level (``job.log_level``: 'debug', 'info', 'warning') on the root logger; below 'debug' the
    ``IMPORT_NOTES`` loggers say only their errors."""
    logging.getLogger().setLevel(level.upper())
    for name in IMPORT_NOTES:
        logging.getLogger(name).setLevel(logging.NOTSET if level == "debug" else logging.ERROR)


@contextlib.contextmanager
def third_party_detail(*loggers: str) -> Iterator[None]:
    """Inside the block, third-party output is detail, shown at the run's DEBUG level only.

    At DEBUG nothing changes. Above it the ``loggers`` (library logger names, e.g. "datasets") say only their
    errors, and what is written to ``sys.stderr`` (progress bars, Python warnings) is held back: written out
    only if the block raises, beside the error it explains. Our own log lines are unaffected (a handler keeps
    the stream it was made with).
    """
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        yield
        return
    named = [logging.getLogger(name) for name in loggers]
    levels = [lg.level for lg in named]
    held = io.StringIO()
    for lg in named:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise
    finally:
        for lg, level in zip(named, levels):
            lg.setLevel(level)


@functools.cache
def warn_once(logger: logging.Logger, message: str) -> None:
    """``logger.warning(message)`` the first time this process sees the pair, then nothing.

    Keyed on the logger too, so the record keeps its module's logger name. Tests call
    ``warn_once.cache_clear()`` to see a warning again.
    """
    logger.warning(message)
