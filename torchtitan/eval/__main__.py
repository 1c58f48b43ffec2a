"""``python -m torchtitan.eval [lm-eval's flags]``: lm-eval's command line with the ``torchtitan`` model registered.

    python -m torchtitan.eval --model torchtitan \\
        --model_args config=train_configs/sft_debug.toml,checkpoint=outputs/sft_debug/checkpoint/step-60 \\
        --tasks arith_mc [--include_path MY_TASKS] [--limit 20] [--log_samples --output_path out/]
    torchrun --nproc_per_node 2 -m torchtitan.eval ...   # the config's layout (FSDP2 or TP) over the ranks

lm-eval 0.4.13 loads no model plugin by itself, so this registers ours first and then hands every flag to lm-eval
unchanged. The shipped tasks (torchtitan/eval/tasks/) are always on the task path. Before lm-eval starts, the task
names and the task files under ``--include_path`` are checked (one line each, exit 2), as is a missing lm-eval.
"""

from __future__ import annotations

import os
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


def _with_shipped_tasks(argv: list[str], include_path: str | None) -> list[str]:
    """``argv`` with ``--include_path`` naming the shipped tasks (and the user's folder after them)."""
    rest, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--include_path" and i + 1 < len(argv):
            skip = True
            continue
        if not arg.startswith("--include_path="):
            rest.append(arg)
    # lm-eval's --include_path takes one folder: the shipped tasks are linked in beside the user's
    return [*rest, "--include_path", _merged_task_folder(include_path)]


def _merged_task_folder(include_path: str | None) -> str:
    if include_path is None:
        return SHIPPED_TASKS
    import tempfile

    merged = tempfile.mkdtemp(prefix="torchtitan_eval_tasks_")
    os.symlink(SHIPPED_TASKS, os.path.join(merged, "torchtitan_shipped"))
    os.symlink(os.path.abspath(include_path), os.path.join(merged, "user"))
    return merged


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
    from lm_eval.__main__ import cli_evaluate

    import torchtitan.eval.lm  # noqa: F401  registers --model torchtitan

    sys.argv = ["lm-eval", *_with_shipped_tasks(argv, include_path)]
    try:
        cli_evaluate()
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
