"""Memory estimator: ``python estimation.py --job.config_file FILE [--world_size N] [--json] [--plan ...]``.

Thin entry point; the estimator lives in torchtitan/estimation (see docs/estimation.md).
"""

import gc
import sys

gc.disable()  # the imports below (torch, the estimator) without the cyclic collector rescanning them as they load

from torchtitan.estimation.cli import main

# They stay loaded until exit: out of the collector's scans, which every estimate's full collection
# (estimation/tracker.py) would otherwise repeat over them (--plan for 8B on 64 ranks: 2.7 -> 1.6 CPU-s of collection)
gc.freeze()
gc.enable()

if __name__ == "__main__":
    sys.exit(main())
