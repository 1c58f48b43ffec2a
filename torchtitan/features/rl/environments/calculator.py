"""The shipped environment: a calculator on the arithmetic task (``rl.environment =
"torchtitan.features.rl.environments.calculator:CalculatorEnvironment"``, train_configs/grpo_calc.toml), and its
partial-credit variant (``ShapedCalculatorEnvironment``: a right call earns part of the reward)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torchtitan.features.rl.environments import EnvStep
from torchtitan.features.rl.rewards import exact_match, number_match

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


class ShapedCalculatorEnvironment(CalculatorEnvironment):
    """``CalculatorEnvironment`` with partial credit: ``CALL_CREDIT`` for the episode's first call whose value is the
    answer's number (the operands copied right), then the final turn's exact match as there: an episode earns 0,
    ``CALL_CREDIT``, 1 or 1 + ``CALL_CREDIT``. A sampled episode that copies the operands but not the sentence is
    told apart from one that copies nothing, which the exact match alone scores the same (docs/rl.md)."""

    CALL_CREDIT = 0.5

    def reset(self, row: Mapping[str, Any]) -> None:
        super().reset(row)
        self.credited = False

    def step(self, turn: str) -> EnvStep:
        out = super().step(turn)
        if out.reply is None or self.credited or not out.reply.startswith("<result>") or "error:" in out.reply:
            return out
        value = out.reply.removeprefix("<result>").removesuffix("</result>")
        self.credited = number_match(prompt="", completion=value, row=self.row) == 1.0
        return EnvStep(out.reply, self.CALL_CREDIT if self.credited else 0.0)
