"""``python -m torchtitan.launch TORCHRUN_ARGS``: see launcher.py."""

from __future__ import annotations

import sys

from torchtitan.launch.entry import launcher_main

if __name__ == "__main__":
    sys.exit(launcher_main()(sys.argv[1:]))
