"""``python -m torchtitan.launch TORCHRUN_ARGS``: see launcher.py."""

from __future__ import annotations

import os
import sys

# A lost node's rendezvous store makes c10d's C++ side log warnings with stack frames in the launcher; the
# launcher tells it in one line (node_watch.py). torch reads the level once, at import; the ranks keep theirs.
_LEVEL = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ["TORCH_CPP_LOG_LEVEL"] = _LEVEL or "ERROR"

from torchtitan.launch.launcher import main  # noqa: E402 - after the level is set

if _LEVEL is None:
    del os.environ["TORCH_CPP_LOG_LEVEL"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
