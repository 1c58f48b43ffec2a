"""Multi-turn environments (``rl.environment = "module:Class"``): the protocol, its loader and the shipped calculator.

An environment plays the other side of an episode. The loop (episodes.py) builds one per completion, calls
``reset(row)`` with the prompt's row, then ``step(turn)`` each time the model ends a turn (its end-of-turn token),
with the text of that turn. ``step`` answers with an ``EnvStep``: a ``reply`` (text the loop appends as a user turn
of the chat template, after which the model speaks again) or None to end the episode, and a ``reward``; the episode's
reward is the sum of its steps'. The environment's tokens are not the policy's: they are out of the loss, its token
counts and the ratio.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torchtitan.features.rl.rewards import exact_match


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
            f"{where}: expected 'module:Class', e.g. 'torchtitan.features.rl.environments:CalculatorEnvironment'"
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


# -- the shipped environment: a calculator on the arithmetic task ---------------------------------------------------

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_OPERAND = 10**12  # a calculator, not a bignum engine: larger values are answered as an error


class CalcError(ValueError):
    pass


def evaluate(expression: str) -> int:
    """An integer expression of + - * / (exact integer division), unary minus and parentheses; no ``eval``.

    Raises:
        CalcError: anything else (a name, a float, a division with a remainder or by 0, an unbalanced parenthesis).
    """
    tokens = re.findall(r"\d+|[-+*/()]|\S", expression)
    value, rest = _sum(tokens)
    if rest:
        raise CalcError(f"unexpected {rest[0]!r}")
    return value


def _sum(tokens: list[str]) -> tuple[int, list[str]]:
    value, tokens = _product(tokens)
    while tokens and tokens[0] in "+-":
        op, (right, tokens) = tokens[0], _product(tokens[1:])
        value = _checked(value + right if op == "+" else value - right)
    return value, tokens


def _product(tokens: list[str]) -> tuple[int, list[str]]:
    value, tokens = _unary(tokens)
    while tokens and tokens[0] in "*/":
        op, (right, tokens) = tokens[0], _unary(tokens[1:])
        if op == "*":
            value = _checked(value * right)
        elif right == 0 or value % right:
            raise CalcError(f"{value}/{right} is not a whole number")
        else:
            value //= right
    return value, tokens


def _unary(tokens: list[str]) -> tuple[int, list[str]]:
    if not tokens:
        raise CalcError("the expression ends early")
    head, tokens = tokens[0], tokens[1:]
    if head == "-":
        value, tokens = _unary(tokens)
        return -value, tokens
    if head == "(":
        value, tokens = _sum(tokens)
        if not tokens or tokens[0] != ")":
            raise CalcError("a '(' is not closed")
        return value, tokens[1:]
    if head.isdigit():
        return _checked(int(head)), tokens
    raise CalcError(f"unexpected {head!r}")


def _checked(value: int) -> int:
    if abs(value) > MAX_OPERAND:
        raise CalcError(f"a value beyond {MAX_OPERAND:.0e}")
    return value


class CalculatorEnvironment:
    """The arithmetic task with a calculator: a turn holding ``<calc>EXPR</calc>`` is answered
    ``<result>VALUE</result>`` (``<result>error: ...</result>`` for what it cannot compute) and the model speaks
    again; a turn without a call ends the episode, scored as ``rewards.exact_match`` against the row's ``answer``."""

    def reset(self, row: Mapping[str, Any]) -> None:
        self.row = row

    def step(self, turn: str) -> EnvStep:
        call = CALL.search(turn)
        if call is None:
            return EnvStep(None, exact_match(prompt="", completion=turn, row=self.row))
        try:
            result = str(evaluate(call.group(1)))
        except CalcError as e:
            result = f"error: {e}"
        return EnvStep(f"<result>{result}</result>")
