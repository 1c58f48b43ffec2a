"""Memory estimator: ``python estimation.py --job.config_file FILE [--world_size N] [--json] [--plan ...]``.

Thin entry point; the estimator lives in torchtitan/estimation (see docs/estimation.md).
"""

import sys

from torchtitan.estimation.cli import main

if __name__ == "__main__":
    sys.exit(main())
