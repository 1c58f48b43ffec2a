"""Environments for the RL tests: one that answers a random-init policy's first turn whatever it says (such a policy
never writes a calculator call), so every episode has environment tokens."""

from __future__ import annotations

from tests.support.rl_rewards import digits
from torchtitan.features.rl.environments import EnvStep


class ReplyOnce:
    """Replies ``<result>7</result>`` to an episode's first turn, then ends it scored by ``rl_rewards.digits`` of the
    second (plus a share of the first's length, so a group's rewards differ)."""

    def reset(self, row: dict) -> None:
        self.first = None

    def step(self, turn: str) -> EnvStep:
        if self.first is None:
            self.first = turn
            return EnvStep("<result>7</result>", 0.01 * len(turn))
        return EnvStep(None, digits(prompt="", completion=turn, row={}))
