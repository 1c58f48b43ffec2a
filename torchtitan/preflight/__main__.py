"""The pre-launch config check: ``python -m torchtitan.preflight [--world_size N] [--target KIND] ARGS``.

Parses and checks the config in one process, before any process group exists, so a mistake is one
line on stderr and exit code 2 instead of a traceback on every rank; a config that passes prints one
``ok:`` line on stdout naming what was checked. ``run_llama_train.sh``'s launcher
(``python -m torchtitan.preflight_launch``, in the launcher's process) and ``scripts/multinode_trainer.slurm`` run it
before torchrun. ARGS are the trainer's own arguments;
``--world_size`` (default 1) is the number of processes the run will have.

``--target KIND`` checks for the machines the run will train on (KIND: their device kind, e.g. ``cuda``)
from any machine, e.g. a CPU login node: the device checks run for KIND instead of this machine's
device, and the checks of this machine's files, packages and environment are skipped and listed as
"not checked here" in the ``ok:`` line (the ranks check them where they start).
"""

from __future__ import annotations

import sys

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig, format_help, print_help, wants_help
from torchtitan.distributed.backend.device import DEVICE_TYPES, get_device_info
from torchtitan.preflight.checks import CHECKS, not_checked_here, run_preflight, skips

USAGE = f"""python -m torchtitan.preflight [--world_size N] [--target {{{",".join(DEVICE_TYPES)}}}] ARGS: check the \
config the trainer would get from ARGS; prints one `ok:` line, or one `error:` line and exits 2
  --world_size N   the number of processes the run will have (default 1)
  --target KIND    the device kind of the machines the run will train on, to check from another machine (a
                   login node): the device checks run for KIND, and those of this machine's files, packages and
                   environment are listed as "not checked here" (default: this machine, every check)
"""


def _pop_flag(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """``--name V`` / ``--name=V`` out of argv -> (V, or None where absent; the remaining arguments)."""
    for i, arg in enumerate(argv):
        if arg == name or arg.startswith(f"{name}="):
            if "=" in arg:
                return arg.partition("=")[2], argv[:i] + argv[i + 1 :]
            return (argv[i + 1] if i + 1 < len(argv) else ""), argv[:i] + argv[i + 2 :]
    return None, argv


def _launch_flags(argv: list[str]) -> tuple[int, str | None, list[str]]:
    """(--world_size, --target or None, the trainer's arguments) out of argv."""
    world_size, argv = _pop_flag(argv, "--world_size")
    if world_size is not None and (not world_size.isdigit() or int(world_size) < 1):
        raise ConfigError(f"--world_size needs a positive integer (the number of processes), got {world_size!r}")
    target, argv = _pop_flag(argv, "--target")
    if target is not None and target not in DEVICE_TYPES:
        raise ConfigError(
            f"--target needs the device kind of the machines the run will train on, one of {list(DEVICE_TYPES)}, "
            f"got {target!r}"
        )
    return int(world_size or 1), target, argv


def _ok_line(config: JobConfig, world_size: int, target: str | None, device_type: str, num_warnings: int) -> str:
    """The one line a passing check prints: the file, the world size, the device kind, what ran and what did not."""
    this_machine = target is None
    passed = sum(not skips(c, this_machine=this_machine, device_type=device_type) for c in CHECKS)
    where = "this machine" if this_machine else "--target"
    source = config.built_by.describe() if config.built_by else config.job.config_file
    line = f"ok: {source or 'the default config'}, world_size {world_size}, device {device_type} "
    line += f"({where}): {passed} checks passed"
    line += f", {num_warnings} warning{'s' * (num_warnings != 1)}" if num_warnings else ""
    if not this_machine:
        line += f"; not checked here (on the {target} machines): {', '.join(not_checked_here(config))}"
    return line


def main(argv: list[str]) -> int:
    """Print the keys (``--help``), or check the config: exit 0 with one ``ok:`` line, or 2 with one ``error:`` line."""
    if wants_help(argv):
        print_help(USAGE, format_help())
        return 0
    try:
        world_size, target, argv = _launch_flags(argv)
        config = JobConfig.parse_args(argv, world_size=world_size)
        device_type = target or get_device_info(0).device.type  # the cluster's kind, or the trainer's pick here
        warnings = run_preflight(config, world_size, this_machine=target is None, device_type=device_type)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(_ok_line(config, world_size, target, device_type, len(warnings)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
