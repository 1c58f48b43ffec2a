"""Build the shipped fine-tuning assets: a small chat tokenizer and a learnable arithmetic chat task.

Writes, under ``--output`` (default ``tests/assets/sft``):

- ``tokenizer/tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE trained on the task's
  text, digits split one per token (so sums are learnable digit by digit), special tokens
  ``<|endoftext|>`` (pad), ``<|im_start|>`` and ``<|im_end|>`` (eos: the end of a turn), and a ChatML
  ``chat_template`` that writes a default system prompt when a conversation has none;
- ``arith_train.jsonl``: chat rows ``{"messages": [...]}`` asking "What is A plus B?" (and a few
  paraphrases) for 0 <= A, B <= MAX_OPERAND, answered "A plus B is C." (or "C" under the system
  prompt ``NUMBER_ONLY``); some rows with a system message, some with two questions;
- ``arith_val.jsonl``: one single-turn row per held-out pair (``is_held_out``), none of them trained;
- ``arith_prompt_completion.jsonl``: ``{"prompt", "completion"}`` rows of training pairs;
- ``README.md``: what each file is.

Deterministic: a fixed seed, and the BPE trainer breaks ties by token ids, so a rerun writes the same
files (``tests/unit/test_sft_assets.py`` checks it). Only the stdlib and ``tokenizers``.

Usage:
    python scripts/build_sft_assets.py [--output tests/assets/sft]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = "tests/assets/sft"
SEED = 35
MAX_OPERAND = 19  # operands 0..19: 400 ordered pairs, sums 0..38
NUM_TRAIN_ROWS = 400
NUM_PROMPT_COMPLETION_ROWS = 50
# Token lengths of the rows with CHAT_TEMPLATE, as measured by tests/unit/test_sft_assets.py (stated in
# the README; this script has no jinja2 to render the template itself)
SINGLE_TURN_TOKENS = (29, 42)
TWO_TURN_TOKENS = (60, 72)
VOCAB_SIZE = 384  # at most: 3 special tokens + 256 bytes + merges (training stops once every word is one token)

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
VOCAB_MULTIPLE = 16
DEFAULT_SYSTEM = "Add numbers."
NUMBER_ONLY = "Answer with the number only."
SYSTEM_PROMPTS = (DEFAULT_SYSTEM, NUMBER_ONLY, "Be helpful.")

# ChatML with a default system prompt; a system message anywhere but first is refused.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
    "{%- else %}"
    "{%- set system = '" + DEFAULT_SYSTEM + "' %}{%- set turns = messages %}"
    "{%- endif %}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
    "{%- for message in turns %}"
    "{%- if message['role'] not in ['user', 'assistant'] %}"
    "{{- raise_exception('only the first message may be a system message; got ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# (weight, question): the canonical question most often
QUESTIONS = (
    (6, "What is {a} plus {b}?"),
    (1, "What is {a} + {b}?"),
    (1, "How much is {a} plus {b}?"),
    (1, "Add {a} and {b}."),
    (1, "What is the sum of {a} and {b}?"),
)
FOLLOW_UP = "And {a} plus {b}?"


def is_held_out(a: int, b: int) -> bool:
    """The pairs never trained on: (a*a + b*b) % 11 == 1, symmetric, so "b plus a" is held out too."""
    return (a * a + b * b) % 11 == 1


def _pairs(held_out: bool) -> list[tuple[int, int]]:
    r = range(MAX_OPERAND + 1)
    return [(a, b) for a in r for b in r if is_held_out(a, b) == held_out]


def _question(rng: random.Random, a: int, b: int) -> str:
    weights, texts = zip(*QUESTIONS)
    return rng.choices(texts, weights=weights)[0].format(a=a, b=b)


def _answer(a: int, b: int, system: str | None) -> str:
    return str(a + b) if system == NUMBER_ONLY else f"{a} plus {b} is {a + b}."


def _conversation(rng: random.Random, pairs: list[tuple[int, int]], *, system: str | None) -> dict:
    """A chat row over one or two pairs (a second pair is asked as a follow-up)."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    for i, (a, b) in enumerate(pairs):
        text = _question(rng, a, b) if i == 0 or rng.random() < 0.5 else FOLLOW_UP.format(a=a, b=b)
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": _answer(a, b, system)})
    return {"messages": messages}


class _PairCycle:
    """Training pairs in a shuffled order, reshuffled each pass, so every pair is asked about evenly."""

    def __init__(self, rng: random.Random, pairs: list[tuple[int, int]]):
        self.rng, self.pairs, self.order = rng, pairs, []

    def next(self) -> tuple[int, int]:
        if not self.order:
            self.order = list(self.pairs)
            self.rng.shuffle(self.order)
        return self.order.pop()


def build_rows(seed: int = SEED) -> tuple[list[dict], list[dict], list[dict]]:
    """(train chat rows, held-out chat rows, prompt/completion rows)."""
    rng = random.Random(seed)
    cycle = _PairCycle(rng, _pairs(held_out=False))
    train = []
    for _ in range(NUM_TRAIN_ROWS):
        kind = rng.random()
        system = rng.choice(SYSTEM_PROMPTS) if kind < 0.25 else None
        num_questions = 2 if 0.25 <= kind < 0.5 else 1
        train.append(_conversation(rng, [cycle.next() for _ in range(num_questions)], system=system))
    val = []
    for a, b in _pairs(held_out=True):
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.25 else None
        val.append(_conversation(rng, [(a, b)], system=system))
    prompt_completion = []
    for _ in range(NUM_PROMPT_COMPLETION_ROWS):
        a, b = cycle.next()
        prompt_completion.append({"prompt": _question(rng, a, b), "completion": _answer(a, b, None)})
    return train, val, prompt_completion


def _plain_text(row: dict) -> str:
    """A row as the template lays it out, without the special tokens (the BPE trainer does not split
    them out of its input, so they would only spend merges)."""
    if "messages" in row:
        messages = row["messages"]
        if messages[0]["role"] != "system":
            messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
    else:
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
    return "".join(f"{m['role']}\n{m['content']}\n" for m in messages)


def train_tokenizer(texts: list[str]) -> tokenizers.Tokenizer:
    """A byte-level BPE over ``texts``: every byte encodable, digits one per token, specials at ids 0-2."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Reserved tokens up to a multiple of VOCAB_MULTIPLE, so tensor parallel (which shards the embedding and
    # output over the vocabulary) runs at degree 2, 4, 8 and 16; they never occur in the data.
    short = -tok.get_vocab_size(with_added_tokens=True) % VOCAB_MULTIPLE
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    return tok


def tokenizer_config() -> dict:
    """What transformers (and ``HFTokenizer``: bos/eos/pad) read beside ``tokenizer.json``."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _readme(num_train: int, num_val: int, num_pc: int, vocab: int) -> str:
    held = len(_pairs(held_out=True))
    return f"""# Fine-tuning test assets

Generated by `scripts/build_sft_assets.py` (seed {SEED}); do not edit by hand. Rebuild with

    python scripts/build_sft_assets.py --output tests/assets/sft

`tests/unit/test_sft_assets.py` checks that a rebuild writes these files (`tokenizer.json` compared by
content, as its layout may change with the `tokenizers` version).

The task: "What is A plus B?" for 0 <= A, B <= {MAX_OPERAND}, answered "A plus B is C." (or just "C"
under the system prompt "{NUMBER_ONLY}").

| file | what |
|---|---|
| `tokenizer/tokenizer.json` | byte-level BPE, {vocab} tokens (reserved tokens pad it to a multiple of 16 for tensor parallel), trained on this task's text; digits are split one per token; special tokens `<|endoftext|>` (0, pad), `<|im_start|>` (1), `<|im_end|>` (2, eos: the end of a turn) |
| `tokenizer/tokenizer_config.json` | `eos_token` `<|im_end|>`, `pad_token` `<|endoftext|>`, no bos, and a ChatML `chat_template` that writes the system prompt "{DEFAULT_SYSTEM}" when a conversation has none (the generation prompt is `<|im_start|>assistant\\n`). Loads in transformers (`AutoTokenizer.from_pretrained`) and `torchtitan.datasets.sft.chat_template.ChatTokenizer` with the same ids |
| `arith_train.jsonl` | {num_train} chat rows `{{"messages": [{{"role", "content"}}, ...]}}`: about a quarter with a system message, a quarter with two questions (the second sometimes "And A plus B?"), the question sometimes paraphrased ("What is A + B?", "Add A and B.", ...) |
| `arith_val.jsonl` | {num_val} single-turn chat rows, one per held-out pair |
| `arith_prompt_completion.jsonl` | {num_pc} rows `{{"prompt", "completion"}}` over training pairs |

Held out: the {held} ordered pairs with `(A*A + B*B) % 11 == 1` (symmetric, so "B plus A" is held out
too) appear in no training or prompt/completion row, only in `arith_val.jsonl`.

Lengths with the chat template (`tests/unit/test_sft_assets.py` measures them): a single-turn row is
{SINGLE_TURN_TOKENS[0]}-{SINGLE_TURN_TOKENS[1]} tokens, so a 128-token window holds three; a two-question row {TWO_TURN_TOKENS[0]}-{TWO_TURN_TOKENS[1]}.
"""


def build_assets(output: Path, seed: int = SEED) -> None:
    """Write every asset under ``output``."""
    train, val, prompt_completion = build_rows(seed)
    tok = train_tokenizer([_plain_text(row) for row in train + prompt_completion])
    (output / "tokenizer").mkdir(parents=True, exist_ok=True)
    (output / "tokenizer" / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config_text = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    (output / "tokenizer" / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    _write_jsonl(output / "arith_train.jsonl", train)
    _write_jsonl(output / "arith_val.jsonl", val)
    _write_jsonl(output / "arith_prompt_completion.jsonl", prompt_completion)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    counts = (len(train), len(val), len(prompt_completion))
    (output / "README.md").write_text(_readme(*counts, vocab), encoding="utf-8")
    logger.info("wrote %s: vocab %d, %d train, %d val, %d prompt/completion rows", output, vocab, *counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="folder to write (created if missing)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_assets(Path(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
