"""The fine-tuning data layer (torchtitan/datasets/sft): chat templates rendered and tokenized as transformers
does, assistant-only label masks, prompt/completion rows, one-line data errors, and packing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
import torch
from transformers import PreTrainedTokenizerFast

from torchtitan.datasets.sft.chat_template import ChatTokenizer, render_chat
from torchtitan.datasets.sft.examples import ColumnMap, build_example
from torchtitan.datasets.sft.packing import pack_examples, windows_to_tensors
from torchtitan.models.common.documents import IGNORE_INDEX, block_causal_mask

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, how are you today?",
    "Python lists are mutable sequences; tuples are immutable. What is 2 + 2? It is 4.",
    "You are a helpful assistant. Answer briefly and politely, with short sentences.",
]

# Qwen2.5-like: a default system prompt when the conversation has none, `-` whitespace control
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama-3-like: bos_token, a trimmed content, role checks through raise_exception
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if loop.first and message['role'] == 'assistant' %}"
    "{{ raise_exception('Conversation must start with a user or system message') }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# ChatML with transformers' {% generation %} marker around each assistant turn and its end-of-turn text
MARKED = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
LLAMA3_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And the quick brown fox?"},
    {"role": "assistant", "content": "It jumps over the lazy dog."},
]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level BPE with chat special tokens, trained on a few sentences (milliseconds)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok.to_str()


def _folder(root: Path, name: str, tokenizer_json: str, tokens: dict, template: str | None) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "tokenizer.json").write_text(tokenizer_json)
    config = dict(tokens, **({"chat_template": template} if template is not None else {}))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def _both(tmp_path: Path, tokenizer_json: str, tokens: dict, template: str | None):
    """Our ChatTokenizer and transformers' tokenizer over the same files."""
    folder = _folder(tmp_path, "tok", tokenizer_json, tokens, template)
    named = {k: v for k, v in tokens.items() if v is not None}
    hf = PreTrainedTokenizerFast(tokenizer_file=f"{folder}/tokenizer.json", chat_template=template, **named)
    return ChatTokenizer(folder), hf


def _hf_ids(hf: PreTrainedTokenizerFast, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _trained_runs(tok: ChatTokenizer, tokens: list[int], labels: list[int]) -> list[str]:
    """The decoded text of each contiguous run of trained labels."""
    runs, current = [], []
    for label in labels + [IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            runs.append(tok.base.decode(current))
            current = []
    return runs


@pytest.mark.parametrize(
    "template,tokens", [(CHATML, CHATML_TOKENS), (LLAMA3, LLAMA3_TOKENS)], ids=["chatml", "llama3"]
)
def test_token_ids_equal_transformers(tmp_path, tokenizer_json, template, tokens):
    ours, hf = _both(tmp_path, tokenizer_json, tokens, template)
    no_system = CONVERSATION[1:]
    for messages in (CONVERSATION, no_system, CONVERSATION[:2]):
        for gen in (False, True):
            text = render_chat(ours.template_source(), messages, add_generation_prompt=gen, variables=ours.variables)
            assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.encode_chat(text)[0] == _hf_ids(hf, messages, gen)
        ids, _ = ours.tokenize_chat(messages)
        assert ids == _hf_ids(hf, messages, False)
    if template == CHATML:  # the template's {% if %} branch: a default system prompt
        assert "system\nYou are a helpful assistant." in ours.base.decode(ours.tokenize_chat(no_system)[0])


@pytest.mark.parametrize(
    "template,tokens,end",
    [(CHATML, CHATML_TOKENS, "<|im_end|>\n"), (LLAMA3, LLAMA3_TOKENS, "<|eot_id|>")],
    ids=["chatml", "llama3"],
)
def test_labels_cover_exactly_the_assistant_turns(tmp_path, tokenizer_json, template, tokens, end):
    ours, hf = _both(tmp_path, tokenizer_json, tokens, template)
    tokens_out, labels = build_example({"messages": CONVERSATION}, ours)
    full = _hf_ids(hf, CONVERSATION, False)
    assert tokens_out == full[:-1] and len(labels) == len(tokens_out)
    assert all(label in (IGNORE_INDEX, target) for label, target in zip(labels, full[1:]))  # next-token alignment
    text = hf.apply_chat_template(CONVERSATION, tokenize=False)
    expected = [m["content"] + end for m in CONVERSATION if m["role"] == "assistant"]
    assert all(turn in text for turn in expected)  # the rendered text's assistant substrings
    assert _trained_runs(ours, tokens_out, labels) == expected


def test_generation_markers_agree_with_transformers_mask(tmp_path, tokenizer_json):
    ours, hf = _both(tmp_path, tokenizer_json, CHATML_TOKENS, MARKED)
    out = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, in_turn = ours.tokenize_chat(CONVERSATION)
    assert ids == list(out["input_ids"]) and [int(x) for x in in_turn] == list(out["assistant_masks"])
    assert 0 < sum(in_turn) < len(ids)


def test_builtin_template_without_a_chat_template(tmp_path, tokenizer_json):
    ours, hf = _both(tmp_path, tokenizer_json, CHATML_TOKENS, None)
    assert not ours.has_chat_template
    tokens_out, labels = build_example({"messages": CONVERSATION}, ours)
    text = ours.base.decode(tokens_out)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n")
    assert _trained_runs(ours, tokens_out, labels) == [
        "It is 4.<|im_end|>\n",
        "It jumps over the lazy dog.<|im_end|>\n",
    ]


def test_prompt_completion_masks_the_prompt(tmp_path, tokenizer_json):
    row = {"prompt": "What is 2 + 2?", "completion": "It is 4."}
    chat = ChatTokenizer(_folder(tmp_path, "chat", tokenizer_json, LLAMA3_TOKENS, LLAMA3))
    tokens_out, labels = build_example(row, chat, loss_on="completion")
    assert build_example(row, chat, loss_on="assistant") == (tokens_out, labels)
    assert chat.base.decode(tokens_out).startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>")
    assert _trained_runs(chat, tokens_out, labels) == ["It is 4.<|eot_id|>"]
    plain = ChatTokenizer(
        _folder(
            tmp_path, "plain", tokenizer_json, {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"}, None
        )
    )
    tokens_out, labels = build_example(row, plain, loss_on="completion")
    ids = tokens_out + [labels[-1]]
    assert ids[0] == plain.base.bos_id and ids[-1] == plain.base.eos_id
    assert plain.base.decode(ids[1:-1]) == "What is 2 + 2?It is 4."  # concatenated as given
    assert _trained_runs(plain, tokens_out, labels) == ["It is 4.<|endoftext|>"]


def test_loss_on_all_and_column_map(tmp_path, tokenizer_json):
    chat = ChatTokenizer(_folder(tmp_path, "chat", tokenizer_json, CHATML_TOKENS, CHATML))
    ids, _ = chat.tokenize_chat(CONVERSATION)
    tokens_out, labels = build_example({"messages": CONVERSATION}, chat, loss_on="all")
    assert tokens_out == ids[:-1] and labels == ids[1:]
    renamed = {"conv": [{"from": m["role"], "value": m["content"]} for m in CONVERSATION]}
    columns = ColumnMap(messages="conv", role="from", content="value")
    assert build_example(renamed, chat, columns=columns) == build_example({"messages": CONVERSATION}, chat)


@pytest.mark.parametrize(
    "row,loss_on,message",
    [
        ({"text": "hi"}, "assistant", "no 'messages' column"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "assistant", "unknown role 'bot'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "assistant", "no assistant turn"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "assistant", "chat template error: Conversation must"),
        (
            {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]},
            "all",
            "must be a string",
        ),
        ({"messages": CONVERSATION}, "completion", "loss_on='completion' needs prompt/completion"),
    ],
    ids=["no_messages", "unknown_role", "no_assistant", "template_error", "null_content", "completion_on_chat"],
)
def test_bad_rows_raise_one_line(tmp_path, tokenizer_json, row, loss_on, message):
    chat = ChatTokenizer(_folder(tmp_path, "chat", tokenizer_json, LLAMA3_TOKENS, LLAMA3))
    with pytest.raises(ValueError) as info:
        build_example(row, chat, loss_on=loss_on, source="data/train.jsonl", row_index=7)
    text = str(info.value)
    assert text.startswith("data/train.jsonl: row 7: ") and message in text and "\n" not in text


def test_template_that_rewrites_history_is_refused(tmp_path, tokenizer_json):
    # renders only the last assistant turn's content in full: an earlier turn changes when more follow
    template = "{% for m in messages %}{{ m.role }}:{{ m.content if loop.last else m.content[:3] }}\n{% endfor %}"
    chat = ChatTokenizer(_folder(tmp_path, "chat", tokenizer_json, CHATML_TOKENS, template))
    with pytest.raises(ValueError, match="data.jsonl: row 0: the chat template renders message 2"):
        build_example({"messages": CONVERSATION}, chat, source="data.jsonl")


def _example(n: int, first: int, trained_from: int = 0) -> tuple[list[int], list[int]]:
    tokens = list(range(first, first + n))
    return tokens, [t + 1 if i >= trained_from else IGNORE_INDEX for i, t in enumerate(tokens)]


def test_packing_keeps_examples_apart(tmp_path):
    examples = [_example(n, 100 * i, trained_from=1) for i, n in enumerate([5, 3, 7, 2, 4, 6])]
    windows, stats = pack_examples(examples, seq_len=10, pad_id=0)
    assert sorted(i for w in windows for i in w.examples) == list(range(6))  # every example, once, whole
    assert [w.examples for w in windows] == [[2, 1], [5, 4], [0, 3]]  # first-fit decreasing
    assert max(len(w.examples) for w in windows) >= 2 and all(len(w.tokens) == 10 for w in windows)
    for w in windows:
        for doc, i in enumerate(w.examples):
            where = [k for k, d in enumerate(w.doc_ids) if d == doc]
            assert [w.tokens[k] for k in where] == examples[i][0] and [w.positions[k] for k in where] == list(
                range(len(where))
            )
        real = sum(len(examples[i][0]) for i in w.examples)
        assert w.tokens[real:] == [0] * (10 - real) and w.labels[real:] == [IGNORE_INDEX] * (10 - real)
        assert set(w.doc_ids[real:]) <= {len(w.examples)}
    batch = windows_to_tensors(windows)
    mask = block_causal_mask(batch["doc_ids"], batch["doc_ids"])[:, 0]  # (n, s, s)
    same = batch["doc_ids"][:, :, None] == batch["doc_ids"][:, None, :]
    assert not (mask & ~same).any()  # no position sees another example
    assert stats.windows == 3 and stats.tokens == 27 and stats.padding == 3 and stats.trained_tokens == 21
    assert stats.non_pad_fraction == pytest.approx(0.9) and (stats.truncated, stats.dropped) == (0, 0)
    assert pack_examples(examples, seq_len=10, pad_id=0) == (windows, stats)  # deterministic


def test_packing_overlong_policy():
    examples = [_example(12, 0), _example(4, 100), _example(12, 200, trained_from=9)]
    windows, stats = pack_examples(examples, seq_len=8, pad_id=0, overlong="truncate")
    assert (stats.truncated, stats.dropped, stats.packed) == (1, 1, 2)  # the third trains nothing in its first 8
    assert windows[0].tokens == list(range(8)) and windows[1].examples == [1]
    windows, stats = pack_examples(examples, seq_len=8, pad_id=0, overlong="drop")
    assert (stats.truncated, stats.dropped, stats.packed, stats.windows) == (0, 2, 1, 1)
    with pytest.raises(ValueError, match="overlong='cut'"):
        pack_examples(examples, seq_len=8, pad_id=0, overlong="cut")
    with pytest.raises(ValueError, match="example 0: 2 tokens but 1 labels"):
        pack_examples([([1, 2], [2])], seq_len=8, pad_id=0)
    assert windows_to_tensors(windows)["inputs"].dtype == torch.int64
