"""Packing whole fine-tuning examples into ``seq_len`` windows, kept apart by document ids.

Policy: first-fit decreasing. Examples are taken longest first (ties in input order) and each goes
into the first open window with room for all of it, else a new window; so no example is ever split
across windows, and the result is a function of the input order alone. An example longer than
``seq_len`` is, by ``overlong``, either truncated to its first ``seq_len`` tokens (kept only if a
trained label survives; otherwise counted as dropped) or dropped; ``PackingStats`` counts both.

Per window (each list ``seq_len`` long):

* ``tokens``, ``labels``: the examples' inputs and next-token labels back to back (``examples.py``:
  each example's labels already stop at its own last token), then padding at the end only, whose
  labels are ``IGNORE_INDEX``;
* ``doc_ids``: 0, 1, ... per example in the window, the padding one id more (so it attends only
  to itself); what ``components.document_feed.Documents.doc_ids`` and
  ``models.documents.block_causal_mask`` take, one row per window;
* ``positions``: each token's position inside its example (0 at every start; the padding's count
  from 0 too), what ``Documents.positions`` takes with ``model.positions_per_document``.

Today's pre-training feed derives document ids from EOS tokens in the inputs; chat templates put EOS
inside a conversation and an SFT input ends before its last token, so the SFT path must pass these
ids instead (not wired yet: docs/sft.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from torchtitan.models.documents import IGNORE_INDEX

Overlong = Literal["truncate", "drop"]


@dataclass(frozen=True)
class PackedWindow:
    """One ``seq_len`` window: tokens, labels, doc_ids, positions (see the module docstring)."""

    tokens: list[int]
    labels: list[int]
    doc_ids: list[int]
    positions: list[int]
    examples: list[int]  # the input indices of the examples it holds, in window order


@dataclass(frozen=True)
class PackingStats:
    """What packing did: counts of examples and tokens, and the share of window slots that are real tokens."""

    examples: int  # given
    packed: int  # placed in a window (truncated ones included)
    truncated: int  # cut to seq_len and kept
    dropped: int  # longer than seq_len and dropped (overlong="drop", or nothing trained after the cut)
    windows: int
    tokens: int  # real tokens in the windows
    trained_tokens: int  # labels other than IGNORE_INDEX
    padding: int

    @property
    def non_pad_fraction(self) -> float:
        slots = self.tokens + self.padding
        return self.tokens / slots if slots else 0.0


def _fit(
    examples: Sequence[tuple[list[int], list[int]]], seq_len: int, overlong: Overlong
) -> tuple[dict[int, tuple[list[int], list[int]]], int, int]:
    """The examples that go into windows (cut to seq_len where allowed) by input index, and the truncated
    and dropped counts."""
    kept, truncated, dropped = {}, 0, 0
    for i, (tokens, labels) in enumerate(examples):
        if len(tokens) != len(labels):
            raise ValueError(f"example {i}: {len(tokens)} tokens but {len(labels)} labels; build it with build_example")
        if len(tokens) <= seq_len:
            kept[i] = (tokens, labels)
        elif overlong == "truncate" and any(x != IGNORE_INDEX for x in labels[:seq_len]):
            kept[i] = (tokens[:seq_len], labels[:seq_len])
            truncated += 1
        else:
            dropped += 1
    return kept, truncated, dropped


def _assign(lengths: dict[int, int], seq_len: int) -> list[list[int]]:
    """First-fit decreasing: input indices per window, longest first within the packing order."""
    order = sorted(lengths, key=lambda i: (-lengths[i], i))  # ties in input order: deterministic
    windows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        slot = next((w for w, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            windows.append([])
            room.append(seq_len)
            slot = len(windows) - 1
        windows[slot].append(i)
        room[slot] -= lengths[i]
    return windows


def _window(members: list[int], kept: dict[int, tuple[list[int], list[int]]], seq_len: int, pad_id: int):
    tokens, labels, doc_ids, positions = [], [], [], []
    for doc, i in enumerate(members):
        example_tokens, example_labels = kept[i]
        tokens += example_tokens
        labels += example_labels
        doc_ids += [doc] * len(example_tokens)
        positions += range(len(example_tokens))
    pad = seq_len - len(tokens)
    tokens += [pad_id] * pad
    labels += [IGNORE_INDEX] * pad  # padding is never trained
    doc_ids += [len(members)] * pad
    positions += range(pad)
    return PackedWindow(tokens, labels, doc_ids, positions, list(members))


def pack_examples(
    examples: Sequence[tuple[list[int], list[int]]], *, seq_len: int, pad_id: int, overlong: Overlong = "truncate"
) -> tuple[list[PackedWindow], PackingStats]:
    """Pack ``(tokens, labels)`` examples into ``seq_len`` windows (policy in the module docstring).

    Args:
        examples: ``build_example`` outputs, in the data's order.
        pad_id: the token that fills a window's end (never trained; the tokenizer's pad, else eos).
        overlong: "truncate" or "drop" an example longer than ``seq_len``.

    Raises:
        ValueError: ``seq_len`` < 1, an unknown ``overlong``, or an example whose tokens and labels differ in length.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong={overlong!r} is not one of truncate, drop")
    kept, truncated, dropped = _fit(examples, seq_len, overlong)
    assignment = _assign({i: len(t) for i, (t, _) in kept.items()}, seq_len)
    windows = [_window(members, kept, seq_len, pad_id) for members in assignment]
    tokens = sum(len(t) for t, _ in kept.values())
    stats = PackingStats(
        examples=len(examples),
        packed=len(kept),
        truncated=truncated,
        dropped=dropped,
        windows=len(windows),
        tokens=tokens,
        trained_tokens=sum(x != IGNORE_INDEX for _, labels in kept.values() for x in labels),
        padding=len(windows) * seq_len - tokens,
    )
    return windows, stats


def windows_to_tensors(windows: Sequence[PackedWindow]) -> dict[str, torch.Tensor]:
    """Stack windows into (n_windows, seq_len) int64 tensors: inputs, labels, doc_ids, positions."""
    return {
        "inputs": torch.tensor([w.tokens for w in windows], dtype=torch.int64),
        "labels": torch.tensor([w.labels for w in windows], dtype=torch.int64),
        "doc_ids": torch.tensor([w.doc_ids for w in windows], dtype=torch.int64),
        "positions": torch.tensor([w.positions for w in windows], dtype=torch.int64),
    }
