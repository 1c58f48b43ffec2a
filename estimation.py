"""Memory estimator: ``python estimation.py --job.config_file FILE [--world_size N] [--json] [--plan ...]``.

Thin entry point; the estimator lives in torchtitan/estimation (see docs/estimation.md).
"""

import gc
import sys

from torchtitan.estimation.cli import main

if __name__ == "__main__":
    # torch and the estimator stay loaded until exit: out of the collector's scans, which every estimate's full
    # collection (estimation/tracker.py) would otherwise repeat over them (--plan for 8B: 2.7 -> 1.6 CPU-s)
    gc.freeze()
    sys.exit(main())
