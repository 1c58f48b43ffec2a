"""The pre-launch config check: ``python -m torchtitan.preflight [--world_size N] ARGS``.

Parses and checks the config in one process, before any process group exists, so a mistake is one
line on stderr and exit code 2 instead of a traceback on every rank. ``run_llama_train.sh`` and
``scripts/multinode_trainer.slurm`` run it before torchrun. ARGS are the trainer's own arguments;
``--world_size`` (default 1) is the number of processes the run will have.
"""

from __future__ import annotations

import sys

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig, format_help, wants_help
from torchtitan.preflight.checks import run_preflight


def _pop_world_size(argv: list[str]) -> tuple[int, list[str]]:
    """``--world_size N`` / ``--world_size=N`` out of argv -> (N, the remaining arguments)."""
    for i, arg in enumerate(argv):
        if arg == "--world_size" or arg.startswith("--world_size="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            rest = argv[:i] + argv[i + (1 if "=" in arg else 2) :]
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--world_size needs a positive integer (the number of processes), got {value!r}")
            return int(value), rest
    return 1, argv


def main(argv: list[str]) -> int:
    """Print the keys (``--help``), or check the config: exit 0, or 2 with one ``error:`` line."""
    if wants_help(argv):
        print(
            "python -m torchtitan.preflight [--world_size N] ARGS: check the config the trainer would get from ARGS\n"
        )
        print(format_help())
        return 0
    try:
        world_size, argv = _pop_world_size(argv)
        config = JobConfig.parse_args(argv, world_size=world_size)
        for warning in run_preflight(config, world_size):
            print(f"warning: {warning}", file=sys.stderr)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
