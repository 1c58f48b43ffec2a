"""Which lm-eval tasks an evaluation runs: the shipped ones (torchtitan/eval/tasks/), a folder of the user's own
(``include_path``), and lm-eval's (which read their data from the hub: only where it is reachable).

lm-eval skips a task file it cannot parse without a word and says little about a name it does not know; here
both are one line, before any model is built: the file and the parser's message, or the unknown names with the
tasks the local folders hold.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SHIPPED_TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")
INSTALL_HINT = "lm-eval is not installed: pip install -e '.[eval]' (the eval extra, lm-eval==0.4.13)"


def require_lm_eval() -> None:
    """Raise one line naming the extra to install when lm-eval is missing."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise ValueError(INSTALL_HINT) from e


def task_folders(include_path: str | None) -> list[str]:
    """The user's folder (checked to exist) then the shipped one; lm-eval lets a later path override an earlier
    task of the same name, so the user's comes last there (see ``build_task_manager``)."""
    if include_path is not None and not os.path.isdir(include_path):
        raise ValueError(f"include_path = {include_path!r}: no such folder; point it at a folder of task YAMLs")
    return [SHIPPED_TASKS, *([include_path] if include_path else [])]


def check_task_files(folders: list[str]) -> None:
    """Every ``*.yaml`` under ``folders`` parses (lm-eval's own loader, includes followed).

    Raises:
        ValueError: the first file that does not, with the parser's message.
    """
    from lm_eval.tasks._yaml_loader import load_yaml

    for folder in folders:
        for path in sorted(Path(folder).glob("**/*.yaml")):
            try:
                cfg = load_yaml(path, resolve_func=False)
            except Exception as e:  # yaml's errors, a missing include, a bad !function line
                message = " ".join(str(e).split())
                raise ValueError(f"task file {path} does not parse: {type(e).__name__}: {message}") from e
            if not isinstance(cfg, dict) or not (cfg.get("task") or cfg.get("group") or cfg.get("include")):
                raise ValueError(f"task file {path} names no task (a YAML mapping with `task: NAME` is expected)")


def build_task_manager(tasks: list[str], include_path: str | None) -> Any:
    """An lm-eval ``TaskManager`` that finds every name in ``tasks``: over the local folders alone when they hold
    them all (fast: lm-eval's own index is thousands of files), else with lm-eval's tasks too.

    Raises:
        ValueError: a task file under the local folders does not parse; a name no folder holds; a task that reads
            images or audio (``refuse_multimodal``).
    """
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    folders = task_folders(include_path)
    check_task_files(folders)
    local = TaskManager(include_path=folders, include_defaults=False)
    manager = local
    if any(t not in local.all_tasks for t in tasks):
        manager = TaskManager(include_path=folders, include_defaults=True)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f"include_path {include_path!r} and the shipped tasks" if include_path else "the shipped tasks"
        raise ValueError(
            f"unknown task {', '.join(repr(t) for t in unknown)}: not an lm-eval task, nor in {where} "
            f"(found there: {', '.join(local.all_tasks) or 'none'}); check the name or include_path"
        )
    refuse_multimodal(manager, tasks)
    return manager


def refuse_multimodal(manager: Any, tasks: list[str]) -> None:
    """One line, before any model is built, when a task (or a member of a group or tag) reads images or audio
    (``doc_to_image`` / ``doc_to_audio``): this backend scores text only. lm-eval itself would refuse it only
    after the model is built and the task's data is loaded."""
    found: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        entry = manager.task_index.get(name)
        if name in seen or entry is None:
            return
        seen.add(name)
        cfg, kind = entry.cfg or {}, entry.kind.name
        if kind == "TAG":
            members = list(entry.tags)
        elif kind == "GROUP":
            members = [m if isinstance(m, str) else m.get("task") or m.get("group") for m in cfg.get("task", [])]
        else:
            members = []
            if cfg.get("doc_to_image") is not None or cfg.get("doc_to_audio") is not None:
                found.append(name)
        for member in members:
            if isinstance(member, str):
                visit(member)

    for task in tasks:
        visit(task)
    if found:
        shown = ", ".join(repr(t) for t in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        many = len(found) > 1
        raise ValueError(
            f"task{'s' if many else ''} {shown} read{'' if many else 's'} images or audio (doc_to_image / "
            "doc_to_audio): the torchtitan lm-eval backend scores text only; export the checkpoint with "
            "scripts/convert_to_hf.py and run lm-eval's hf-multimodal model on it"
        )
