"""Log formatting; only entry points call ``init_logger``."""

from __future__ import annotations

import logging
import os
import sys


def init_logger(rank: int | None = None) -> None:
    """INFO to stderr with a rank prefix when distributed; idempotent."""
    if rank is None:
        rank = int(os.environ.get("RANK", 0))
    prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in list(root.handlers):
        if getattr(handler, "_torchtitan", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    handler._torchtitan = True
    root.addHandler(handler)
