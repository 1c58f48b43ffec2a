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
# for its quantizer): its optional kernels' .so files that did not load on this machine, and torch's note that
# registering torchao's enums as pytree constants is deprecated. logger -> the texts a dropped message holds, all.
_TORCHAO_IMPORT_NOISE = {
    "torchao": ("Failed to load ", ".so"),
    "torch.utils._pytree": ("register_constant()", "deprecated"),
}


class _DropTorchaoImportNoise(logging.Filter):
    def __init__(self, texts: tuple[str, ...]):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(text in message for text in self.texts)


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Inside, importing torchao (itself or through transformers' model classes) prints none of its import notes
    above (the .so files that did not load, the pytree deprecation of its enums); anything else those loggers say
    passes, and a run at ``job.log_level = 'debug'`` sees them all (``IMPORT_NOTES``). For the entry points that
    import transformers' models before (or without) a run's log level: the pre-launch check, scripts/generate.py."""
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        yield
        return
    filters = [
        (logging.getLogger(name), _DropTorchaoImportNoise(texts)) for name, texts in _TORCHAO_IMPORT_NOISE.items()
    ]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


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
