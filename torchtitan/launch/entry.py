"""The launcher's entry points import it through ``launcher_main``: no torch import before it."""

from __future__ import annotations

import os
from collections.abc import Callable


def launcher_main() -> Callable[..., int]:
    """launcher.main, torch imported with c10d's C++ log level at ERROR unless the user set one.

    A lost node's rendezvous store makes c10d's C++ side log warnings with stack frames in the launcher; the
    launcher tells it in one line (node_watch.py). torch reads the level once, at import; the ranks keep theirs
    (the variable is put back as it was).
    """
    level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = level or "ERROR"
    try:
        from torchtitan.launch.launcher import main
    finally:
        if level is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
    return main
