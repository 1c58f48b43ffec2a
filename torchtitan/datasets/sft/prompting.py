"""Prompting a chat model: a user message as the model saw conversations in fine-tuning, and where its
answer ends.

``chat_prompt_ids`` renders ``[system?, user]`` with the tokenizer's chat template (the built-in ChatML
one when it has none) and the generation prompt, and encodes it with the added tokens recognised: the
ids of ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` in transformers.
The answer ends at the first of ``chat_stop_ids``: the tokenizer's eos, and the end-of-turn tokens of
ChatML (``<|im_end|>``) and Llama 3 (``<|eot_id|>``) templates when they are added tokens, since a
base model's eos (Qwen3's ``<|endoftext|>``) is not what its chat template ends a turn with.

Used by ``scripts/generate.py --chat``; a benchmark calls the same functions in process.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchtitan.datasets.sft.chat_template import ChatTokenizer, render_chat

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>")


def chat_messages(user: str, *, system: str | None = None) -> list[dict[str, str]]:
    """``[system?, user]`` as chat messages."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    return [*messages, {"role": "user", "content": user}]


def chat_prompt_ids(tokenizer: ChatTokenizer, user: str, *, system: str | None = None) -> list[int]:
    """The token ids that ask the model for an assistant turn answering ``user``.

    Raises:
        ValueError: the tokenizer has no template and lacks the built-in one's tokens.
        jinja2.TemplateError: the template fails on the conversation (or calls ``raise_exception``).
    """
    text = render_chat(
        tokenizer.template_source(),
        chat_messages(user, system=system),
        add_generation_prompt=True,
        variables=tokenizer.variables,
    )
    ids, _ = tokenizer.encode_chat(text)
    return ids


def chat_stop_ids(tokenizer: ChatTokenizer) -> tuple[int, ...]:
    """The ids that end an answer, end-of-turn tokens first, then eos (each once).

    Pass them all to ``generate(..., stop_token=...)``, which stops at the first it produces, and cut
    the output at the first of them (``answer_ids``).
    """
    model = tokenizer.base.model
    added = {token.content for token in model.get_added_tokens_decoder().values()}
    ids = [model.token_to_id(token) for token in END_OF_TURN_TOKENS if token in added]
    ids.append(tokenizer.base.eos_id)
    return tuple(dict.fromkeys(ids))


def answer_ids(generated: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """The generated ids before the first stop id (all of them when none was generated)."""
    stops = set(stop_ids)
    for i, token in enumerate(generated):
        if token in stops:
            return list(generated[:i])
    return list(generated)


def decode_answer(tokenizer: ChatTokenizer, generated: Sequence[int], stop_ids: Sequence[int]) -> str:
    """The answer's text: the generated ids before the first stop, special tokens left out."""
    return tokenizer.base.model.decode(answer_ids(generated, stop_ids), skip_special_tokens=True)
