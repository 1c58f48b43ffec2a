"""``python -m torchtitan.eval [lm-eval's flags]``: lm-eval's command line with the ``torchtitan`` model registered.

    python -m torchtitan.eval --model torchtitan \\
        --model_args config=train_configs/sft_debug.toml,checkpoint=outputs/sft_debug/checkpoint/step-60 \\
        --tasks arith_mc [--include_path MY_TASKS] [--limit 20] [--log_samples --output_path out/]
    torchrun --nproc_per_node 2 -m torchtitan.eval ...   # the config's layout (FSDP2 or TP) over the ranks

lm-eval 0.4.13 loads no model plugin by itself, so this registers ours first and then hands every flag to lm-eval
unchanged, but for one addition: the shipped tasks (torchtitan/eval/tasks/) are on the task path before the
``--include_path`` folder (lm-eval's parser takes one folder; its task manager takes a list). Before lm-eval starts, the task
names and the task files under ``--include_path`` are checked (one line each, exit 2), as is a missing lm-eval.
"""

from __future__ import annotations

import sys

from torchtitan.eval.tasks import SHIPPED_TASKS, build_task_manager


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``argv`` (the last one), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tasks, include_path = _flag(argv, "--tasks"), _flag(argv, "--include_path")
    try:
        if tasks is not None:
            build_task_manager([t for t in tasks.split(",") if t], include_path)
        else:
            from torchtitan.eval.tasks import require_lm_eval

            require_lm_eval()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    import torchtitan.eval.lm  # noqa: F401  registers --model torchtitan

    setup_logging()  # what lm-eval's own entry point does first
    saved, sys.argv = sys.argv, ["lm-eval", *argv]  # lm-eval's parser reads sys.argv (and inserts `run`)
    try:
        parser = HarnessCLI()
        args = parser.parse_args()
    finally:
        sys.argv = saved
    if hasattr(args, "include_path"):  # `run`: the shipped tasks, then the user's folder (a later path wins a name)
        args.include_path = [SHIPPED_TASKS, *([args.include_path] if args.include_path else [])]
    try:
        parser.execute(args)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
