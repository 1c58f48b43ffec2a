"""One supervised fine-tuning row -> ``(tokens, labels)``: the model's inputs and their next-token targets.

Two shapes of row:

* chat: ``messages``, a list of ``{"role", "content"}`` with roles system / user / assistant, any
  number of turns and at least one assistant turn; rendered with the tokenizer's chat template
  (``chat_template.py``; the built-in ChatML template when it has none).
* prompt / completion: ``prompt`` and ``completion`` strings. With a chat template they are a user
  turn and an assistant turn; without one they are concatenated as they are (put any separator in
  the data): ``[bos] prompt completion eos`` (no bos when the tokenizer has none).

``ColumnMap`` names other columns. ``loss_on`` chooses the trained tokens: "assistant" (chat: the
assistant turns, each from after the template's assistant header through its end-of-turn text;
prompt/completion: the completion, with its end-of-turn text or eos), "completion" (prompt/completion
rows only; the same tokens as "assistant") or "all" (every token but the first, which nothing predicts).

Alignment as in pre-training (``hf_datasets.py``: input = w[:-1], label = w[1:]): for an example of
n token ids, ``tokens = ids[:-1]`` and ``labels[t] = ids[t + 1]``, or ``IGNORE_INDEX`` where the token
``ids[t + 1]`` is not trained. Both have n - 1 entries, so a packed window never asks one example to
predict the next one's first token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import jinja2

from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.datasets.sft.columns import ColumnMap
from torchtitan.models.common.documents import IGNORE_INDEX

LossOn = Literal["assistant", "completion", "all"]
LOSS_ON = ("assistant", "completion", "all")
ROLES = ("system", "user", "assistant")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _fail(where: str, problem: str) -> ValueError:
    return ValueError(_one_line(f"{where}: {problem}"))


def _read_messages(row: Mapping[str, Any], columns: ColumnMap, where: str) -> list[dict[str, str]]:
    """The row's conversation as plain {"role", "content"} dicts, checked."""
    raw = row[columns.messages]
    if not isinstance(raw, list) or not raw:
        raise _fail(where, f"'{columns.messages}' must be a non-empty list of messages, got {type(raw).__name__}")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, Mapping):
            raise _fail(where, f"message {i} is a {type(message).__name__}, expected an object with role and content")
        role, content = message.get(columns.role), message.get(columns.content)
        if role not in ROLES:
            raise _fail(where, f"message {i} has unknown role {role!r}; allowed: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise _fail(where, f"message {i} ({role}) content must be a string, got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise _fail(where, "the conversation has no assistant turn, so there is nothing to train on")
    return messages


def _read_text(row: Mapping[str, Any], column: str, where: str) -> str:
    value = row[column]
    if not isinstance(value, str):
        raise _fail(where, f"'{column}' must be a string, got {type(value).__name__}")
    return value


def _chat_ids(tokenizer: ChatTokenizer, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[bool]]:
    try:
        return tokenizer.tokenize_chat(messages)
    except jinja2.TemplateError as e:
        raise _fail(where, f"chat template error: {e}") from e
    except ValueError as e:
        raise _fail(where, str(e)) from e


def _concatenated_ids(tokenizer: ChatTokenizer, prompt: str, completion: str) -> tuple[list[int], list[bool]]:
    """``[bos] prompt completion eos`` for a tokenizer without a chat template; the completion and eos trained."""
    head = tokenizer.base.encode(prompt, bos=True, eos=False)
    tail = tokenizer.base.encode(completion, bos=False, eos=True)
    return head + tail, [False] * len(head) + [True] * len(tail)


def _shift(ids: list[int], trained: list[bool]) -> tuple[list[int], list[int]]:
    """Token ids and their trained flags -> (inputs, next-token labels with IGNORE_INDEX where untrained)."""
    labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids[1:], trained[1:])]
    return ids[:-1], labels


def build_example(
    row: Mapping[str, Any],
    tokenizer: ChatTokenizer,
    *,
    loss_on: LossOn = "assistant",
    columns: ColumnMap = ColumnMap(),  # noqa: B008 (frozen, so sharing the default is safe)
    source: str = "<data>",
    row_index: int = 0,
) -> tuple[list[int], list[int]]:
    """One row -> ``(tokens, labels)`` of equal length (see the module docstring).

    Raises:
        ValueError: one line naming ``source`` and ``row_index``: neither shape's columns, a malformed
            or unknown-role message, no assistant turn, ``loss_on='completion'`` on chat data, a chat
            template error, or an example of fewer than two tokens.
    """
    where = f"{source}: row {row_index}"
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on={loss_on!r} is not one of {', '.join(LOSS_ON)}")
    if columns.messages in row:
        if loss_on == "completion":
            raise _fail(where, "loss_on='completion' needs prompt/completion rows; use 'assistant' for chat data")
        ids, trained = _chat_ids(tokenizer, _read_messages(row, columns, where), where)
    elif columns.prompt in row and columns.completion in row:
        prompt = _read_text(row, columns.prompt, where)
        completion = _read_text(row, columns.completion, where)
        if tokenizer.has_chat_template:
            turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            ids, trained = _chat_ids(tokenizer, turns, where)
        else:
            ids, trained = _concatenated_ids(tokenizer, prompt, completion)
    else:
        raise _fail(
            where,
            f"no '{columns.messages}' column (nor '{columns.prompt}' and '{columns.completion}'); the row has "
            f"{sorted(map(str, row))}; name your columns with ColumnMap",
        )
    if len(ids) < 2:
        raise _fail(where, f"the example is {len(ids)} token(s) long; it needs two to predict one")
    if loss_on == "all":
        trained = [True] * len(ids)
    return _shift(ids, trained)
