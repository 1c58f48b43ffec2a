"""The config check moved to ``python -m torchtitan.preflight`` (config/ is a leaf that knows no
feature, and the check runs every feature's own). Fail loudly rather than exit 0 unchecked."""

import sys

if __name__ == "__main__":
    print(
        "error: the config check is now `python -m torchtitan.preflight [--world_size N] ARGS` "
        "(run_llama_train.sh and scripts/multinode_trainer.slurm call it)",
        file=sys.stderr,
    )
    sys.exit(2)
