"""``python -m torchtitan.launch TORCHRUN_ARGS``: see launcher.py."""

from __future__ import annotations

import sys

from torchtitan.launch.launcher import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
