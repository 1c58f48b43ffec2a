"""Tokenizers: the abstract interface, tiktoken-format (Llama 3) and Hugging Face `tokenizer.json` (Qwen3)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from torchtitan.datasets.tokenizer.hf_tokenizer import (
    CONFIG_FILE,
    HFTokenizer,
    find_hf_tokenizer_file,
    is_hf_tokenizer_path,
)
from torchtitan.datasets.tokenizer.tiktoken import DEFAULT_TOKENIZER_PATH, TikTokenizer
from torchtitan.datasets.tokenizer.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_TOKENIZER_PATH",
    "HFTokenizer",
    "TikTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "find_tokenizer_file",
    "tokenizer_digest",
]

# Beside a Hugging Face tokenizer.json, the files that change what it encodes: its special tokens (and chat
# template) in the config, transformers 5's template file.
_HF_COMPANIONS = (CONFIG_FILE, "chat_template.jinja")


def build_tokenizer(tokenizer_path: str) -> Tokenizer:
    """Build the tokenizer stored at `tokenizer_path`.

    A `.json` file or a folder is read as a Hugging Face tokenizer (`HFTokenizer`: the folder's
    `tokenizer.json`, special tokens from `tokenizer_config.json` beside it); anything else as a
    tiktoken-format BPE file (`TikTokenizer`: Llama 3's `tokenizer.model`, the shipped default).

    Raises:
        FileNotFoundError: no file at `tokenizer_path` (or no `tokenizer.json` in the folder).
        ValueError: the file is not in the format its name implies, or (Hugging Face) no end-of-text
            token can be determined.
    """
    if is_hf_tokenizer_path(tokenizer_path):
        return HFTokenizer(tokenizer_path)
    return TikTokenizer(tokenizer_path)


def find_tokenizer_file(tokenizer_path: str) -> Path | None:
    """The file `build_tokenizer(tokenizer_path)` would read, or None when it is not there."""
    if is_hf_tokenizer_path(tokenizer_path):
        return find_hf_tokenizer_file(tokenizer_path)
    p = Path(tokenizer_path)
    return p if p.is_file() else None


def tokenizer_digest(tokenizer_path: str) -> str | None:
    """SHA-256 of what ``build_tokenizer(tokenizer_path)`` reads (the BPE file; a Hugging Face ``tokenizer.json``
    with its config and chat template beside it), None when the file is not there: the same tokenizer in another
    folder or on another machine has the same digest."""
    file = find_tokenizer_file(tokenizer_path)
    if file is None:
        return None
    files = [file]
    if is_hf_tokenizer_path(tokenizer_path):
        files += [file.with_name(name) for name in _HF_COMPANIONS if file.with_name(name).is_file()]
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()
