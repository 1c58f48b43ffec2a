"""Multi-turn episodes (``rl.environment``): a group's completions generated turn by turn against an environment.

One ``generate`` call per group, as without an environment: ``Episodes`` steers it token by token. A row whose model
turn ends (an end-of-turn id) hands the turn's text to its environment (environments.py); a reply is rendered as a
user turn of the chat template and forced into the row one token per decoding step, then the model speaks again. So
every row still grows by one token a step (the KV cache holds), the ranks still agree per token when all are done,
and the episode is a function of the same seeds. The window is ``rl.max_new_tokens`` for the whole episode; a
reply that does not fit in what is left of it ends the episode, one longer than the whole window is an error.

The environment's tokens come back marked (``env_mask`` 1): they are out of the loss, its token counts and the ratio.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchtitan.components.generation import Sampling, generate
from torchtitan.datasets.sft.chat_template import ChatTokenizer, render_chat
from torchtitan.features.rl.environments import EnvStep, load_environment
from torchtitan.features.rl.prompts import Prompt, PromptSource

_ANSWER, _REPLY = "\x00answer\x00", "\x00reply\x00"  # sentinels no template writes


@dataclass(frozen=True)
class Episode:
    ids: list[int]  # every token after the prompt, the model's and the environment's
    logprobs: list[float]  # the generator's per token (0.0 on the environment's)
    env_mask: list[int]  # 1 where the environment wrote the token
    reward: float


class ReplyTurn:
    """An environment's reply as the chat template writes a user turn after the model's ended turn: the template's
    text between the assistant's end-of-turn token and the reply, the reply, then up to the next assistant header."""

    def __init__(self, tokenizer: ChatTokenizer, end_of_turn: str):
        def render(messages: list[dict], generation: bool) -> str:
            return render_chat(
                tokenizer.template_source(), messages, add_generation_prompt=generation, variables=tokenizer.variables
            )

        asked = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ANSWER}]
        before = render(asked, False)
        after = render([*asked, {"role": "user", "content": _REPLY}], True)
        if not after.startswith(before) or _REPLY not in after:
            raise ValueError(
                "rl.environment: the tokenizer's chat template does not write a user turn after an assistant turn as "
                "an appended text; an environment needs such a template (docs/rl.md, Environments)"
            )
        tail = before.split(_ANSWER, 1)[1]  # the assistant's end of turn and what follows it
        head, self.close = after[len(before) :].split(_REPLY)
        self.open = (tail[len(end_of_turn) :] if tail.startswith(end_of_turn) else tail) + head
        self.tokenizer = tokenizer

    def ids(self, reply: str) -> list[int]:
        return self.tokenizer.encode_chat(self.open + reply + self.close)[0]


@dataclass(frozen=True)
class EpisodeSpec:
    """What every group's episodes share: the environment's class and key, the window, the turn limit, the stop ids,
    the reply rendering, and the decoding of a turn's text."""

    env_cls: type
    name: str  # rl.environment, for errors
    max_new_tokens: int
    max_turns: int
    stop_ids: tuple[int, ...]
    reply: ReplyTurn
    decode: Callable[[list[int]], str]


class Episodes:
    """A group's episodes, one environment each, steered through ``generate``'s ``steer`` hook.

    ``error`` holds the first failure (an environment that raised or returned a bad reward, a reply longer than the
    window); its row ends there, and the caller raises it once every rank is done (no rank waits alone).
    """

    def __init__(self, spec: EpisodeSpec, row: Mapping[str, Any], where: str, size: int):
        self.spec, self.where = spec, where
        self.ids: list[list[int]] = [[] for _ in range(size)]
        self.env_mask: list[list[int]] = [[] for _ in range(size)]
        self.queue: list[list[int]] = [[] for _ in range(size)]  # the environment's tokens still to force
        self.turn_start, self.turns = [0] * size, [0] * size
        self.rewards, self.done = [0.0] * size, [False] * size
        self.error: str | None = None
        try:
            self.envs = [spec.env_cls() for _ in range(size)]
            for env in self.envs:
                env.reset(row)
        except Exception as e:  # every row ends at once; the caller raises after the ranks agree
            self.envs, self.done = [None] * size, [True] * size
            self._fail(f"rl.environment {spec.name}: building or reset raised {type(e).__name__}: {e} on {where}")

    def __call__(self, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = sampled.tolist()
        for i, token in enumerate(out):
            if self.done[i]:
                continue  # the row idles to the batch's end; cut off below
            if self.queue[i]:
                out[i] = self.queue[i].pop(0)
                self.ids[i].append(out[i])
                self.env_mask[i].append(1)
                if not self.queue[i]:
                    self.turn_start[i] = len(self.ids[i])
                continue
            self.ids[i].append(token)
            self.env_mask[i].append(0)
            if token in self.spec.stop_ids:
                self._end_turn(i, self.ids[i][self.turn_start[i] : -1])
        return torch.tensor(out, device=sampled.device), torch.tensor(self.done, device=sampled.device)

    def _end_turn(self, i: int, turn: list[int], *, last: bool = False) -> None:
        """Row ``i``'s model turn ended (``last``: the window did): its environment's step, then its reply queued."""
        spec = self.spec
        self.turns[i] += 1
        step = self._step(i, spec.decode(turn))
        if step is None or step.reply is None or last or self.turns[i] >= spec.max_turns:
            self.done[i] = True
            return
        reply = spec.reply.ids(step.reply)
        if len(reply) > spec.max_new_tokens and self.error is None:
            self.error = (
                f"rl.environment {spec.name}: its reply on {self.where} is {len(reply)} tokens, more than the episode's "
                f"whole window rl.max_new_tokens = {spec.max_new_tokens} (reply {step.reply[:60]!r}); shorten the "
                "environment's replies or raise rl.max_new_tokens (and training.seq_len)"
            )
        if len(reply) >= spec.max_new_tokens - len(self.ids[i]):  # no room for it and a model token: the episode ends
            self.done[i] = True
            return
        self.queue[i] = reply

    def _step(self, i: int, turn: str) -> EnvStep | None:
        """The environment's step, its reward added to the row's; None (the error kept) when it fails."""
        where = f"rl.environment {self.spec.name}"
        try:
            step = self.envs[i].step(turn)
        except Exception as e:
            self._fail(f"{where} raised {type(e).__name__}: {e} on {where_turn(self.where, turn)}")
            return None
        reward = getattr(step, "reward", None)
        if not isinstance(step, EnvStep) or not isinstance(step.reply, (str, type(None))):
            self._fail(f"{where} returned {step!r} on {where_turn(self.where, turn)}, not an EnvStep(reply, reward)")
        elif isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            self._fail(f"{where} returned the reward {reward!r} on {where_turn(self.where, turn)}, not a finite number")
        else:
            self.rewards[i] += float(reward)
            return step
        return None

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = f"{message}; fix the environment (docs/rl.md, Environments)"

    def finish(self, logprobs: list[list[float]]) -> list[Episode]:
        """The episodes once generation has stopped: a row the window cut mid-turn gives its environment that turn."""
        for i in range(len(self.ids)):
            if not self.done[i]:
                self._end_turn(i, self.ids[i][self.turn_start[i] :], last=True)
        return [
            Episode(ids, [0.0 if env else lp for lp, env in zip(lps, mask)], mask, reward)
            for ids, lps, mask, reward in zip(self.ids, logprobs, self.env_mask, self.rewards)
        ]


def where_turn(where: str, turn: str) -> str:
    return f"{where} (the model's turn {turn[:60]!r})"


@torch.no_grad()
def generate_episodes(
    model: nn.Module,
    prompt: Prompt,
    spec: EpisodeSpec,
    *,
    group_size: int,
    sampling: Sampling,
    seed: int,
    device: torch.device,
    where: str,
    all_done: Callable[[torch.Tensor], bool] | None = None,
    pad_multiple: int = 1,
) -> tuple[list[Episode], str | None]:
    """``group_size`` episodes of ``prompt`` (generation_group's seeds and arguments) and the first error, or None."""
    ids = torch.tensor([prompt.ids] * group_size, dtype=torch.long, device=device)  # (group_size, n)
    generator = torch.Generator(device=device).manual_seed(seed)
    episodes = Episodes(spec, prompt.row, where, group_size)
    logprobs: list[torch.Tensor] = []
    generate(
        model,
        ids,
        spec.max_new_tokens,
        sampling,
        stop_token=spec.stop_ids,
        generator=generator,
        logprobs=logprobs,
        all_done=all_done,
        pad_multiple=pad_multiple,
        steer=episodes,
    )
    lps = torch.stack(logprobs, dim=1).tolist() if logprobs else [[] for _ in range(group_size)]
    return episodes.finish(lps), episodes.error


def episode_spec(rl: Any, prompts: PromptSource, stop_ids: tuple[int, ...]) -> EpisodeSpec | None:
    """The run's episodes (its ``[rl]`` section), or None without ``rl.environment``.

    Raises:
        ValueError: the environment does not load (environments.load_environment), or the template cannot frame it.
    """
    if not rl.environment:
        return None
    tokenizer = prompts.tokenizer
    end_of_turn = tokenizer.base.model.id_to_token(stop_ids[0]) or ""
    return EpisodeSpec(
        load_environment(rl.environment),
        rl.environment,
        rl.max_new_tokens,
        rl.max_turns,
        stop_ids,
        ReplyTurn(tokenizer, end_of_turn),
        prompts.decode,
    )
