"""The tokenizer interface the data pipeline and the trainer depend on."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Tokenizer(ABC):
    """Maps text to token ids and back; `n_words` is the model's vocabulary size."""

    @abstractmethod
    def encode(self, s: str, *, bos: bool, eos: bool) -> list[int]:
        """Encode `s`, optionally framed by the begin/end-of-text ids."""

    def encode_prompt(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids (generation, evaluation), framed by the tokenizer's own rule: here the training
        documents' (bos, where it has one, then the text); a Hugging Face tokenizer's is transformers'
        ``tokenizer(text)`` (``HFTokenizer.encode_prompt``). ``add_special_tokens=False``: the text alone."""
        return self.encode(text, bos=add_special_tokens, eos=False)

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
