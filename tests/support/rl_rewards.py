"""Rewards for the RL tests: ones that vary between a random-init policy's completions, and faulty ones."""

from __future__ import annotations

_calls = {"n": 0}


def digits(*, prompt: str, completion: str, row: dict) -> float:
    """The share of the completion's characters that are digits (a random policy's completions differ in it)."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1) + 0.01 * len(completion)


def raises_after_first_step(*, prompt: str, completion: str, row: dict) -> float:
    """``digits`` for the first 12 completions this process scores, then an error."""
    _calls["n"] += 1
    if _calls["n"] > 12:
        raise KeyError("expected_sum")
    return digits(prompt=prompt, completion=completion, row=row)


def not_a_number(*, prompt: str, completion: str, row: dict) -> str:
    return "yes"
