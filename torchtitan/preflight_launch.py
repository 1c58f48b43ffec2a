"""The pre-launch check, then the launch, in one process (what run_llama_train.sh runs).

Usage: ``python -m torchtitan.preflight_launch TORCHRUN_ARGS -m torchtitan.train ARGS``.

What ``run_llama_train.sh`` runs (with ``PREFLIGHT=0``, ``python -m torchtitan.launch``: no check). torchrun's
arguments, as for ``python -m torchtitan.launch``. Before any rank starts, ``python -m torchtitan.preflight``'s check
of the trainer's arguments, for the run's world size (nproc_per_node x nnodes): its one ``ok:`` line, or its one
``error:`` line and exit code 2 (no rank starts). The same check as the command of its own, without a second
interpreter importing torch first (~2.5 s a launch on 2 CPU cores).
"""

from __future__ import annotations

import sys
from argparse import Namespace

from torchtitan.launch.entry import launcher_main
from torchtitan.launch.failures import EXIT_USER_ERROR


def _fixed_nodes(nnodes: str) -> int | None:
    """torchrun's ``--nnodes`` as one number of nodes; None for a range (elastic) or what is not a number."""
    from torch.distributed.run import parse_min_max_nnodes  # torch: imported by launcher_main first

    try:
        low, high = parse_min_max_nnodes(nnodes)
    except ValueError:
        return None
    return low if low == high else None


def check_before_ranks(args: Namespace) -> int:
    """The pre-launch check of torchrun's parsed ``args``' trainer arguments; its exit code (0: its ``ok:`` line)."""
    from torchtitan.preflight.__main__ import main as check

    if not (args.module and args.training_script == "torchtitan.train"):
        print(
            "error: python -m torchtitan.preflight_launch checks the trainer's config: launch -m torchtitan.train "
            f"(got {'-m ' * bool(args.module)}{args.training_script}); python -m torchtitan.launch starts any script",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    nodes = _fixed_nodes(str(args.nnodes))
    if not str(args.nproc_per_node).isdigit() or nodes is None:
        print(
            "error: the pre-launch check needs the run's world size: a number for --nproc_per_node (got "
            f"{args.nproc_per_node!r}) and one for --nnodes (got {args.nnodes!r}); or check with "
            "python -m torchtitan.preflight --world_size N and launch with python -m torchtitan.launch",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    code = check(["--world_size", str(int(args.nproc_per_node) * nodes), *args.training_script_args])
    sys.stdout.flush()  # its line before the ranks' output
    return code


def main(argv: list[str]) -> int:
    return launcher_main()(argv, before_ranks=check_before_ranks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
