"""Multi-turn environments (``rl.environment = "module:Class"``): the protocol, its loader and the shipped calculator.

An environment plays the other side of an episode. The loop (episodes.py) builds one per completion, calls
``reset(row)`` with the prompt's row, then ``step(turn)`` each time the model ends a turn (its end-of-turn token),
with the text of that turn. ``step`` answers with an ``EnvStep``: a ``reply`` (text the loop appends as a user turn
of the chat template, after which the model speaks again) or None to end the episode, and a ``reward``; the episode's
reward is the sum of its steps'. The environment's tokens are not the policy's: they are out of the loss, its token
counts and the ratio. The loop is episodes.py; the shipped environment, calculator.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one model turn: ``reply`` None ends the episode."""

    reply: str | None
    reward: float = 0.0


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: Mapping[str, Any]) -> None:
        """A new episode on the prompt ``row`` (the JSONL row: its ``messages`` and every other field)."""

    def step(self, turn: str) -> EnvStep:
        """The model's turn (its text, special tokens left out) -> the reply, or None to end, and a reward."""


def load_environment(spec: str) -> type:
    """The class ``spec`` ("module:Class") names, checked to build and to have ``reset`` and ``step``.

    Raises:
        ValueError: not "module:Class", the module does not import, no such class, its constructor raises, or the
            object has no ``reset``/``step``.
    """
    module_name, sep, name = spec.partition(":")
    where = f"rl.environment = {spec!r}"
    if not sep or not module_name or not name:
        raise ValueError(
            f"{where}: expected 'module:Class', e.g. 'torchtitan.features.rl.environments.calculator:CalculatorEnvironment'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{where}: module {module_name!r} cannot be imported ({e}); put it on PYTHONPATH") from e
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        found = sorted(
            n
            for n, v in vars(module).items()
            if isinstance(v, type) and v.__module__ == module.__name__ and not n.startswith("_")
        )[:8]
        raise ValueError(f"{where}: {module_name} has no class {name!r} (it has: {', '.join(found)})")
    try:
        env = cls()
    except Exception as e:
        raise ValueError(
            f"{where}: {name}() raised {type(e).__name__}: {e}; an environment is built with no arguments"
        ) from e
    if not isinstance(env, Environment):
        raise ValueError(f"{where}: {name} has no reset(row) and step(turn) methods (docs/rl.md, Environments)")
    return cls
