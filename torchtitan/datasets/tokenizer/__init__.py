"""Tokenizers: the abstract interface and the tiktoken-format (Llama 3) implementation."""

from __future__ import annotations

from torchtitan.datasets.tokenizer.tiktoken import DEFAULT_TOKENIZER_PATH, TikTokenizer
from torchtitan.datasets.tokenizer.tokenizer import Tokenizer

__all__ = ["DEFAULT_TOKENIZER_PATH", "TikTokenizer", "Tokenizer", "build_tokenizer"]


def build_tokenizer(tokenizer_path: str) -> Tokenizer:
    """Build the tokenizer stored at `tokenizer_path` (a tiktoken-format BPE file).

    Raises:
        FileNotFoundError: no file at `tokenizer_path`.
        ValueError: the file is not in tiktoken BPE format.
    """
    return TikTokenizer(tokenizer_path)
