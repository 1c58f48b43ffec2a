"""Rewards: ``rl.reward = "module:function"``, a Python callable per completion, and the shipped ones.

A reward is called as ``function(prompt=str, completion=str, row=dict) -> float``: the prompt's text as the
model saw it (rendered), the completion's text up to its stop (special tokens left out) and the prompt row's
fields (the JSONL row, e.g. its ``answer``). The shipped ones score the arithmetic task (tests/assets/rl: rows
"What is A plus B?" with ``answer`` "A plus B is C."); they read ``row["answer"]``.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

Reward = Callable[..., float]

_ARITH_ANSWER = re.compile(r"\d+ plus \d+ is \d+\.")


def exact_match(*, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """1 where the completion is the row's ``answer`` (surrounding whitespace aside), else 0."""
    return float(completion.strip() == str(row["answer"]).strip())


def _last_integer(text: str) -> int | None:
    numbers = re.findall(r"\d+", text)
    return int(numbers[-1]) if numbers else None


def number_match(*, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """1 where the completion's last integer is the ``answer``'s last integer, else 0."""
    expected = _last_integer(str(row["answer"]))
    return float(expected is not None and _last_integer(completion) == expected)


def format_reward(*, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """1 where the completion has the task's shape, "A plus B is C." (whatever the numbers), else 0."""
    return float(_ARITH_ANSWER.fullmatch(completion.strip()) is not None)


def load_reward(spec: str) -> Reward:
    """The callable ``spec`` ("module:function") names.

    Raises:
        ValueError: not "module:function", the module cannot be imported, or it has no such callable.
    """
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(
            f"rl.reward = {spec!r}: expected 'module:function', e.g. 'torchtitan.features.rl.rewards:exact_match'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"rl.reward = {spec!r}: module {module_name!r} cannot be imported ({e}); put it on PYTHONPATH or fix the name"
        ) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:8]
        raise ValueError(f"rl.reward = {spec!r}: {module_name} has no function {name!r} (it has: {', '.join(found)})")
    return fn


def score(fn: Reward, spec: str, *, prompt: str, completion: str, row: Mapping[str, Any], where: str) -> float:
    """``fn``'s reward for one completion, as a float.

    Raises:
        ValueError: the reward raised, or returned something that is not a finite number (naming ``spec``,
            ``where`` (the prompt row) and what it returned).
    """
    try:
        value = fn(prompt=prompt, completion=completion, row=row)
    except Exception as e:
        raise ValueError(
            f"rl.reward {spec} raised {type(e).__name__}: {e} on {where} (completion {completion[:60]!r}); fix the "
            "function or the prompt rows"
        ) from e
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"rl.reward {spec} returned {value!r} ({type(value).__name__}) on {where} (completion {completion[:60]!r}); "
            "a reward must be a finite int or float"
        )
    return float(value)
