"""The prompts an RL run samples: a JSONL file read once, rendered to token ids, sampled as a function of the seed
and the step (not of the layout), so a resumed run or another layout sees the same prompts at the same step.

A row is a chat row (``messages``: the conversation so far, its last message a user turn, rendered with the
tokenizer's chat template and the assistant's header) or a ``prompt`` row (the text as a user turn). Every field of
the row reaches the reward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jinja2
import torch

from torchtitan.config.parse_errors import parsing
from torchtitan.datasets.sft.chat_template import ChatTokenizer, render_chat
from torchtitan.datasets.sft.prompting import chat_stop_ids

_MIX = 1_000_003  # seeds of (seed, step, round, ...) as one integer: a polynomial in this prime


def mix_seed(*parts: int) -> int:
    """One 63-bit seed from several integers (seed, step, round, index)."""
    value = 0
    for part in parts:
        value = (value * _MIX + part + 1) % (1 << 63)
    return value


@dataclass(frozen=True)
class Prompt:
    index: int
    """The row's index in the file."""
    ids: list[int]
    text: str
    """What the model sees, rendered (its special tokens as text)."""
    row: dict[str, Any]


def _render(tokenizer: ChatTokenizer, row: dict[str, Any], where: str) -> tuple[str, list[int]]:
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        if messages[-1].get("role") != "user":
            raise ValueError(
                f"{where}: the last message is a {messages[-1].get('role')!r} turn; a prompt ends with a user turn"
            )
    elif isinstance(row.get("prompt"), str):
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        raise ValueError(f"{where}: a prompt row has 'messages' (chat) or a 'prompt' string; got keys {sorted(row)}")
    try:
        text = render_chat(
            tokenizer.template_source(), messages, add_generation_prompt=True, variables=tokenizer.variables
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"{where}: the chat template failed on this row: {e}") from e
    return text, tokenizer.encode_chat(text)[0]


class PromptSource:
    """The prompts of ``path``, rendered once; ``sample(step, round)`` picks a step's prompts.

    Round 0 of step s reads positions (s-1)*n .. s*n-1 of an endless stream: each epoch of the file in an order
    drawn from (seed, epoch), so every row is used once per epoch. DAPO's refill rounds (round >= 1) draw n more
    from (seed, step, round). Checkpoints save what the position depends on (nothing but the step): the state
    records the file and the step's shape, so a resume with other prompts or group sizes is refused.
    """

    def __init__(
        self,
        path: str,
        tokenizer: ChatTokenizer,
        *,
        seed: int,
        per_step: int,
        group_size: int,
        max_new_tokens: int,
        seq_len: int,
    ):
        self.path, self.seed, self.per_step, self.group_size = path, seed, per_step, group_size
        self.prompts: list[Prompt] = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                where = f"rl.prompts_path {path} line {i + 1}"
                with parsing(f"rl.prompts_path {path}", "valid JSON", line=i + 1, fix="fix or remove that row"):
                    row = json.loads(line)
                text, ids = _render(tokenizer, row, where)
                if len(ids) + max_new_tokens > seq_len:
                    raise ValueError(
                        f"{where}: its prompt is {len(ids)} tokens and rl.max_new_tokens = {max_new_tokens}, more than "
                        f"training.seq_len = {seq_len}; raise training.seq_len to at least {len(ids) + max_new_tokens}, "
                        "lower rl.max_new_tokens, or drop the row"
                    )
                self.prompts.append(Prompt(len(self.prompts), ids, text, row))
        if not self.prompts:
            raise ValueError(f"rl.prompts_path {path} has no rows")
        self.seq_len = seq_len
        self.stop_ids = chat_stop_ids(tokenizer)
        self.tokenizer = tokenizer
        self._order: tuple[int, torch.Tensor] | None = None

    @classmethod
    def of_run(cls, rl, training, tokenizer: ChatTokenizer) -> PromptSource:
        """The run's prompts (its ``[rl]`` and ``[training]`` sections): the trainer's and an outside engine's."""
        return cls(
            rl.prompts_path,
            tokenizer,
            seed=training.seed,
            per_step=rl.prompts_per_step,
            group_size=rl.group_size,
            max_new_tokens=rl.max_new_tokens,
            seq_len=training.seq_len,
        )

    def decode(self, ids: list[int]) -> str:
        """A completion's text, special tokens left out (what the reward reads)."""
        return self.tokenizer.base.model.decode(ids, skip_special_tokens=True)

    def sample(self, step: int, round: int = 0) -> list[Prompt]:
        """The ``per_step`` prompts of ``step``'s sampling ``round``."""
        n = len(self.prompts)
        if round > 0:
            g = torch.Generator().manual_seed(mix_seed(self.seed, step, round))
            return [self.prompts[i] for i in torch.randint(n, (self.per_step,), generator=g).tolist()]
        picked = []
        for position in range((step - 1) * self.per_step, step * self.per_step):
            epoch, i = divmod(position, n)
            picked.append(self.prompts[int(self._epoch_order(epoch)[i])])
        return picked

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
            self._order = (epoch, torch.randperm(len(self.prompts), generator=g))
        return self._order[1]

    # The checkpointer's data state (checkpointing/state.py): what a resume must agree on.
    def state_dict(self) -> dict[str, Any]:
        return {
            "num_streams": self.per_step * self.group_size,
            "seq_len": self.seq_len,
            "rl_prompts": f"{self.path} ({len(self.prompts)} rows)",
            "streams": {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        if state.get("rl_prompts") != mine["rl_prompts"]:
            raise ValueError(
                f"the checkpoint's RL prompts are {state.get('rl_prompts')!r}, this run's {mine['rl_prompts']!r}; "
                "resume with the same rl.prompts_path"
            )

    def __iter__(self):
        return iter(())
