"""Log formatting; only entry points call ``init_logger``."""

from __future__ import annotations

import functools
import logging
import sys


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


@functools.cache
def warn_once(logger: logging.Logger, message: str) -> None:
    """``logger.warning(message)`` the first time this process sees the pair, then nothing.

    Keyed on the logger too, so the record keeps its module's logger name. Tests call
    ``warn_once.cache_clear()`` to see a warning again.
    """
    logger.warning(message)
