"""The tokenizer interface the data pipeline and the trainer depend on."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Tokenizer(ABC):
    """Maps text to token ids and back; `n_words` is the model's vocabulary size."""

    @abstractmethod
    def encode(self, s: str, *, bos: bool, eos: bool) -> list[int]:
        """Encode `s`, optionally framed by the begin/end-of-text ids."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Decode token ids to text (special tokens are rendered as their text)."""

    @property
    @abstractmethod
    def n_words(self) -> int:
        """Vocabulary size, special tokens included: the model's embedding rows."""

    @property
    @abstractmethod
    def bos_id(self) -> int:
        """Id of the begin-of-text token; -1 when the tokenizer has none (then `encode(bos=True)` prepends nothing)."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """Id of the end-of-text token."""

    @property
    def pad_id(self) -> int:
        """Id of the padding token; -1 when the tokenizer has none."""
        return -1
