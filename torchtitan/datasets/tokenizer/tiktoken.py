"""Llama-3-style byte-level BPE tokenizer over `tiktoken`.

Works with Meta's Llama 3 `tokenizer.model` (128,000 BPE ranks) and with any BPE file in the same
format, e.g. the small one shipped for offline runs (see `scripts/train_tokenizer.py`).
"""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import tiktoken

from torchtitan.datasets.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Llama 3's pre-tokenization: contractions, letter runs with one leading non-letter, 1-3 digit
# groups, punctuation runs, newlines, and whitespace that does not swallow the next word's space.
PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_SPECIAL_TOKENS = 256
DEFAULT_TOKENIZER_PATH = "torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken"

# tiktoken's Rust core can hit pathological time/stack use on huge inputs, and on long runs of
# whitespace or non-whitespace; Llama 3 encodes in chunks bounded by these limits.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_RUN_RE = re.compile(r"\s+|\S+")


def special_token_names(num_special_tokens: int = NUM_SPECIAL_TOKENS) -> list[str]:
    """Llama 3's special tokens in id order (reserved slots fill the table to its fixed size)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(5, num_special_tokens - 5)]
    return named + reserved


def load_bpe_ranks(path: str) -> dict[bytes, int]:
    """Read a tiktoken BPE file: one `<base64 token bytes> <rank>` per line.

    Parsed here rather than with `tiktoken.load.load_tiktoken_bpe`, which caches local files by
    *path* under the system temp dir and so returns stale ranks after a file is regenerated.
    """
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:
                raise ValueError(
                    f"{path}: line {lineno}: expected '<base64 token> <rank>' (tiktoken BPE format), "
                    f"got {line[:60]!r}; pass a tiktoken-format file such as Llama 3's tokenizer.model"
                ) from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: BPE ranks must be unique and cover 0..{len(ranks) - 1}; regenerate the file")
    return ranks


def split_long_runs(s: str, max_run: int) -> Iterator[str]:
    """Cut `s` into consecutive pieces none of which holds a whitespace/non-whitespace run > max_run."""
    start = 0
    for m in _RUN_RE.finditer(s):
        run_start, run_end = m.span()
        for cut in range(run_start + max_run, run_end, max_run):
            yield s[start:cut]
            start = cut
    yield s[start:]


class TikTokenizer(Tokenizer):
    """Llama 3 tokenizer: BPE ranks from `model_path`, then 256 special tokens right after them.

    Args:
        model_path: a tiktoken-format BPE file (Llama 3's `original/tokenizer.model`, or the shipped
            `torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken`).

    Raises:
        FileNotFoundError: `model_path` does not exist.
    """

    def __init__(self, model_path: str) -> None:
        if not Path(model_path).is_file():
            raise FileNotFoundError(
                f"tokenizer file not found: {model_path!r}; download Llama 3's with "
                f"`python scripts/download_tokenizer.py --hf_token <token>` or use the shipped default "
                f"{DEFAULT_TOKENIZER_PATH!r}"
            )
        mergeable_ranks = load_bpe_ranks(model_path)
        num_base_tokens = len(mergeable_ranks)
        self.special_tokens = {name: num_base_tokens + i for i, name in enumerate(special_token_names())}
        self.model = tiktoken.Encoding(
            name=Path(model_path).name,
            pat_str=PAT_STR,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        self._n_words = num_base_tokens + len(self.special_tokens)
        self._bos_id = self.special_tokens["<|begin_of_text|>"]
        self._eos_id = self.special_tokens["<|end_of_text|>"]
        logger.info(
            "loaded tokenizer %s: %d BPE ranks + %d special = %d words (bos %d, eos %d)",
            model_path,
            num_base_tokens,
            len(self.special_tokens),
            self._n_words,
            self._bos_id,
            self._eos_id,
        )

    def encode(self, s: str, *, bos: bool, eos: bool) -> list[int]:
        """Encode `s`; special-token text inside `s` is encoded as ordinary text, never as specials."""
        ids: list[int] = [self._bos_id] if bos else []
        for i in range(0, len(s), MAX_ENCODE_CHARS):
            for piece in split_long_runs(s[i : i + MAX_ENCODE_CHARS], MAX_RUN_CHARS):
                # documents are untrusted text: "<|end_of_text|>" in a web page must not end it
                ids.extend(self.model.encode(piece, allowed_special=set(), disallowed_special=()))
        if eos:
            ids.append(self._eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode(list(ids))

    @property
    def n_words(self) -> int:
        return self._n_words

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id
