"""Hugging Face `tokenizer.json` tokenizers (Qwen3's, and any other) over the `tokenizers` library.

A `tokenizer.json` holds the vocabulary, the merges and the added tokens, but not which token begins
or ends a text: transformers reads that from the `tokenizer_config.json` beside it (`bos_token`,
`eos_token`, `pad_token`), and so do we. Qwen3 has no begin-of-text token (`bos_token: null`; its
documents are separated by the end-of-text token only), so there `encode(bos=True)` prepends nothing
and `bos_id` is -1.

`encode` frames training documents (our rule: bos where the config names one, special-token text as plain text).
A prompt (generation, evaluation, RL) is encoded as transformers' `tokenizer(text)` encodes it (`encode_prompt`):
special-token text is the token, and the special tokens added are the post-processor's of `tokenizer.json`, which
need not add the `bos_token` the config names (`prompt_model`).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import tokenizers

from torchtitan.config.parse_errors import parsing
from torchtitan.datasets.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
_FETCH_HINT = "fetch Qwen3's with `python scripts/download_tokenizer.py --repo_id Qwen/Qwen3-8B`"


def find_hf_tokenizer_file(path: str) -> Path | None:
    """`path` if it names a `.json` file, `path/tokenizer.json` if `path` is a folder holding one, else None."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKENIZER_FILE
    return p if p.is_file() and p.suffix == ".json" else None


def is_hf_tokenizer_path(path: str) -> bool:
    """Whether `build_tokenizer` reads `path` as a Hugging Face tokenizer: a `.json` file or a folder."""
    p = Path(path)
    return p.suffix == ".json" or p.is_dir()


def _read_config(config_path: Path) -> dict:
    """`tokenizer_config.json` as a dict; {} when the file is absent."""
    if not config_path.is_file():
        return {}
    fix = f"fix that line, or fetch the model repo's {CONFIG_FILE} again"
    try:
        with config_path.open(encoding="utf-8") as f, parsing(config_path, "valid JSON", fix=fix):
            config = json.load(f)
    except OSError as e:
        raise ValueError(f"{config_path}: not readable ({e}); fetch the model repo's {CONFIG_FILE} again") from e
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    return config


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`, with begin/end-of-text and padding tokens from `tokenizer_config.json`.

    Args:
        path: a `tokenizer.json` file, or a folder holding one (as `scripts/download_tokenizer.py`
            saves Qwen3's). The `tokenizer_config.json` beside it names the special tokens.

    Raises:
        FileNotFoundError: no `tokenizer.json` at `path`.
        ValueError: the file is not a Hugging Face tokenizer; no end-of-text token can be determined
            (no `tokenizer_config.json`, or no `eos_token` in it); a named special token is not in the
            vocabulary; the token ids are not 0..n_words-1.
    """

    def __init__(self, path: str) -> None:
        file = find_hf_tokenizer_file(path)
        if file is None:
            where = f"folder {path!r} holds no {TOKENIZER_FILE}" if Path(path).is_dir() else f"{path!r} not found"
            raise FileNotFoundError(
                f"tokenizer file not found: {where}; pass a Hugging Face {TOKENIZER_FILE} or its folder "
                f"({_FETCH_HINT}), or a tiktoken-format file such as Llama 3's tokenizer.model"
            )
        fix = f"pass the {TOKENIZER_FILE} of a model repo ({_FETCH_HINT})"
        # the Rust side raises a bare Exception for any parse error (serde's message names the line and column)
        with parsing(file, f"a Hugging Face {TOKENIZER_FILE}", fix=fix, errors=(Exception,)):
            self.model = tokenizers.Tokenizer.from_file(str(file))
        # documents are untrusted text: "<|endoftext|>" inside a web page must not end it (as in TikTokenizer)
        self.model.encode_special_tokens = True
        self.path = str(file)  # the tokenizer.json read (its folder holds the config and chat template)
        self._n_words = self.model.get_vocab_size(with_added_tokens=True)
        self._check_ids_dense(file)
        config_path = file.with_name(CONFIG_FILE)
        config = _read_config(config_path)
        self._bos_id = self._special_id(config, "bos_token", config_path)
        self._pad_id = self._special_id(config, "pad_token", config_path)
        self._eos_id = self._special_id(config, "eos_token", config_path)
        if self._eos_id < 0:
            missing = "has no eos_token" if config_path.is_file() else "is missing"
            raise ValueError(
                f"cannot tell the end-of-text token of {file}: {config_path} {missing}; put the model repo's "
                f"{CONFIG_FILE} (with an eos_token) beside it; `python scripts/download_tokenizer.py --repo_id <repo>` "
                f"fetches both files"
            )
        logger.info(
            "loaded tokenizer %s: %d words (bos %s, eos %d)",
            file,
            self._n_words,
            self._bos_id if self._bos_id >= 0 else "none",
            self._eos_id,
        )

    def _check_ids_dense(self, file: Path) -> None:
        # n_words sizes the embedding: an id at or above it would index past the table
        top = max(self.model.get_vocab(with_added_tokens=True).values(), default=-1)
        if top >= self._n_words:
            raise ValueError(
                f"{file}: token ids run up to {top} but the vocabulary holds {self._n_words} tokens; the ids "
                "must be 0..n_words-1 (the model's embedding rows); fix the tokenizer's added tokens"
            )

    def _special_id(self, config: dict, key: str, config_path: Path) -> int:
        """The id of the token `config[key]` names (a string or a {"content": ...} dict); -1 when it names none."""
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            return -1
        if not isinstance(value, str):
            raise ValueError(f"{config_path}: {key} must be a string or a {{'content': ...}} object, got {value!r}")
        token_id = self.model.token_to_id(value)
        if token_id is None:
            raise ValueError(
                f"{config_path}: {key} {value!r} is not in the tokenizer's vocabulary; the two files must come "
                "from the same model repo"
            )
        return token_id

    def encode(self, s: str, *, bos: bool, eos: bool) -> list[int]:
        """Encode `s`; special-token text inside `s` is ordinary text. Without a bos token, `bos` adds nothing."""
        ids: list[int] = [self._bos_id] if bos and self._bos_id >= 0 else []
        # add_special_tokens=False: the tokenizer's own post-processor must not frame the text too
        ids.extend(self.model.encode(s, add_special_tokens=False).ids)
        if eos:
            ids.append(self._eos_id)
        return ids

    @functools.cached_property
    def prompt_model(self) -> tokenizers.Tokenizer:
        """The tokenizer as transformers' ``AutoTokenizer`` reads the folder for a prompt: special-token text is the
        special token, and the special tokens added are ``tokenizer.json``'s post-processor's (none where it has
        none). transformers 5 reads the folder so: beside a ``tokenizer.json`` it drops the config's
        ``add_bos_token`` / ``add_eos_token``, and a ``bos_token`` the config names is added only where the
        post-processor adds it."""
        return tokenizers.Tokenizer.from_file(self.path)  # encode_special_tokens off: "<|im_end|>" is the token

    def encode_prompt(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=...).input_ids`` (``prompt_model``)."""
        return self.prompt_model.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode(list(ids), skip_special_tokens=False)

    @property
    def n_words(self) -> int:
        return self._n_words

    @property
    def bos_id(self) -> int:
        """The begin-of-text id; -1 when the tokenizer has none (Qwen3)."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id
