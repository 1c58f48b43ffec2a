"""``python -m torchtitan.eval [lm-eval's flags]``: lm-eval's command line with the ``torchtitan`` model registered.

    python -m torchtitan.eval --model torchtitan \\
        --model_args config=train_configs/sft_debug.toml,checkpoint=outputs/sft_debug/checkpoint/step-60 \\
        --tasks arith_mc [--include_path MY_TASKS] [--limit 20] [--log_samples --output_path out/]
    torchrun --nproc_per_node 2 -m torchtitan.eval ...   # the config's layout (FSDP2 or TP) over the ranks

lm-eval 0.4.13 loads no model plugin by itself, so this registers ours first and then hands every flag to lm-eval,
with three additions: the shipped tasks (torchtitan/eval/tasks/) are on the task path before the
``--include_path`` folder (lm-eval's parser takes one folder; its task manager takes a list); the batch size is
``--batch_size``, else ``--model_args batch_size=``, else the backend's 8 (lm-eval's own default of 1 would
override it); and ``--output_path DIR`` writes into ``DIR/<run>-step-N_<tasks>/`` (``results_name``: lm-eval
names a folder after a ``pretrained=`` argument, which ours has not, or a random id), named in the last line
printed. Before lm-eval starts, the task names and the task files under ``--include_path`` are checked (one line
each, exit 2), as is a missing lm-eval.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

from torchtitan.config.sections.eval import DEFAULT_BATCH_SIZE
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


def results_name(model_args: dict, tasks: list[str]) -> str:
    """The results folder's name: what was evaluated, then the tasks, e.g. 'sft_debug-step-60_arith_mc'.

    ``checkpoint=RUN/checkpoint/step-N`` -> 'RUN-step-N'; ``hf=FOLDER`` -> 'hf-FOLDER' ('hf-RUN-step-N' for an
    export); neither (the seeded init) -> 'init-<config file's stem>'. The same evaluation gets the same folder;
    lm-eval dates each results file in it."""

    def named(path: str) -> str:
        p = Path(path).resolve()
        return f"{p.parent.parent.name}-{p.name}" if p.name.startswith("step-") else p.name

    if model_args.get("checkpoint"):
        what = named(str(model_args["checkpoint"]))
    elif model_args.get("hf"):
        what = "hf-" + named(str(model_args["hf"]))
    else:
        what = "init-" + Path(str(model_args.get("config", "model"))).stem
    shown = tasks if len("+".join(tasks)) <= 60 else [tasks[0], f"{len(tasks) - 1}_more"]  # a path stays short
    return re.sub(r"[^\w.+-]+", "_", f"{what}_{'+'.join(shown)}")


def _settle_batch_size(args: argparse.Namespace) -> None:
    """``--batch_size``, else ``--model_args batch_size=``, else ``DEFAULT_BATCH_SIZE``, as lm-eval's batch size (the
    one it passes to the model, prints and records); both given is an error."""
    model_args = args.model_args if isinstance(args.model_args, dict) else {}
    if "batch_size" in model_args:
        if hasattr(args, "batch_size"):
            raise ValueError(
                f"batch size given twice: --batch_size {args.batch_size} and --model_args batch_size="
                f"{model_args['batch_size']}; pass one"
            )
        args.batch_size = str(model_args.pop("batch_size"))
    elif not hasattr(args, "batch_size"):  # lm-eval's parser leaves an unset --batch_size out (then its default: 1)
        args.batch_size = str(DEFAULT_BATCH_SIZE)


def _name_results(args: argparse.Namespace) -> tuple[Path, str] | None:
    """Where lm-eval writes the results: (folder, the results files' glob), or None (no ``--output_path``). A folder
    ``--output_path DIR`` becomes ``DIR/<results_name>/results.json``, lm-eval's file form (it then writes
    ``results_<date>.json`` and ``samples_<task>_<date>.jsonl`` beside it); a ``.json`` path stays as given."""
    if not args.output_path:
        return None
    out = Path(args.output_path)
    if out.suffix == ".json":
        return out.parent, f"{out.stem}_*.json"
    folder = out / results_name(args.model_args if isinstance(args.model_args, dict) else {}, list(args.tasks or []))
    args.output_path = str(folder / "results.json")
    return folder, "results_*.json"


def _parse(argv: list[str]) -> tuple[Any, argparse.Namespace]:
    """lm-eval's parser over ``argv`` (it reads sys.argv and inserts `run`), with our additions for `run`."""
    from lm_eval._cli import HarnessCLI

    saved, sys.argv = sys.argv, ["lm-eval", *argv]
    try:
        parser = HarnessCLI()
        args = parser.parse_args()
    finally:
        sys.argv = saved
    if hasattr(args, "include_path"):  # `run`, `ls`: the shipped tasks, then the user's folder (a later path wins)
        args.include_path = [SHIPPED_TASKS, *([args.include_path] if args.include_path else [])]
    if args.command == "run":
        _settle_batch_size(args)
    return parser, args


def _check_tasks(argv: list[str]) -> None:
    """The task names and the task files under ``--include_path`` (or lm-eval's presence): ValueError, one line."""
    tasks, include_path = _flag(argv, "--tasks"), _flag(argv, "--include_path")
    if tasks is not None:
        build_task_manager([t for t in tasks.split(",") if t], include_path)
    else:
        from torchtitan.eval.tasks import require_lm_eval

        require_lm_eval()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _check_tasks(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lm_eval.utils import setup_logging

    import torchtitan.eval.lm  # noqa: F401  registers --model torchtitan

    setup_logging()  # what lm-eval's own entry point does first
    try:
        parser, args = _parse(argv)
        results = _name_results(args) if args.command == "run" else None
        before = set() if results is None else set(results[0].glob(results[1]))
        parser.execute(args)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    written = [] if results is None else sorted(set(results[0].glob(results[1])) - before)
    if written and os.environ.get("LOCAL_RANK", "0") == "0":  # lm-eval writes where LOCAL_RANK is 0
        print(f"results: {written[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
