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
  to itself); what ``features.documents.feed.Documents.doc_ids`` and
  ``models.common.documents.block_causal_mask`` take, one row per window;
* ``positions``: each token's position inside its example (0 at every start; the padding's count
  from 0 too), what ``Documents.positions`` takes with ``model.positions_per_document``.

The pre-training feed derives document ids from EOS tokens in the inputs; chat templates put EOS
inside a conversation and an SFT input ends before its last token, so the fine-tuning loader
(``loader.py``) yields these ids with each batch (``PackedDocs``) and the feed takes them as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from torchtitan.models.common.documents import IGNORE_INDEX

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
    examples: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, overlong: Overlong
) -> tuple[dict[int, tuple[Sequence[int], Sequence[int]]], int, int]:
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
    """First-fit decreasing: input indices per window, longest first within the packing order.

    The first window with room is found in a max-tree over the windows' free room (O(log windows)
    per example), so an epoch of 10^5 examples packs in seconds; the result is plain first fit's.
    """
    order = sorted(lengths, key=lambda i: (-lengths[i], i))  # ties in input order: deterministic
    size = 1
    while size < max(len(order), 1):
        size *= 2
    room = [0] * (2 * size)  # leaves: free room of window w at size + w (0 until opened); nodes: max of children
    windows: list[list[int]] = []
    for i in order:
        need = lengths[i]
        if room[1] >= need:
            node = 1
            while node < size:  # leftmost leaf with room >= need
                node = 2 * node if room[2 * node] >= need else 2 * node + 1
            slot = node - size
        else:
            slot = len(windows)
            windows.append([])
            room[size + slot] = seq_len
        windows[slot].append(i)
        node = size + slot
        room[node] -= need
        while node > 1:
            node //= 2
            room[node] = max(room[2 * node], room[2 * node + 1])
    return windows


def _window(
    members: list[int], kept: dict[int, tuple[Sequence[int], Sequence[int]]], seq_len: int, pad_id: int
) -> PackedWindow:
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


@dataclass(frozen=True)
class PackingPlan:
    """Which examples go into which window, before any window is built (windows are built on demand:
    an epoch's plan holds example indices only, not ``seq_len`` lists per window)."""

    kept: dict[int, tuple[Sequence[int], Sequence[int]]]  # input index -> (tokens, labels), cut to seq_len
    windows: list[list[int]]  # per window, the input indices of its examples in window order
    stats: PackingStats


def plan_packing(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]], *, seq_len: int, overlong: Overlong = "truncate"
) -> PackingPlan:
    """The first-fit-decreasing plan of ``examples`` (policy in the module docstring).

    Raises:
        ValueError: ``seq_len`` < 1, an unknown ``overlong``, or an example whose tokens and labels differ in length.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong={overlong!r} is not one of truncate, drop")
    kept, truncated, dropped = _fit(examples, seq_len, overlong)
    assignment = _assign({i: len(t) for i, (t, _) in kept.items()}, seq_len)
    tokens = sum(len(t) for t, _ in kept.values())
    stats = PackingStats(
        examples=len(examples),
        packed=len(kept),
        truncated=truncated,
        dropped=dropped,
        windows=len(assignment),
        tokens=tokens,
        trained_tokens=sum(sum(x != IGNORE_INDEX for x in labels) for _, labels in kept.values()),
        padding=len(assignment) * seq_len - tokens,
    )
    return PackingPlan(kept, assignment, stats)


def build_window(plan: PackingPlan, index: int, *, seq_len: int, pad_id: int) -> PackedWindow:
    """Window ``index`` of ``plan``, built."""
    return _window(plan.windows[index], plan.kept, seq_len, pad_id)


def pack_examples(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    seq_len: int,
    pad_id: int,
    overlong: Overlong = "truncate",
) -> tuple[list[PackedWindow], PackingStats]:
    """Pack ``(tokens, labels)`` examples into ``seq_len`` windows (policy in the module docstring).

    Args:
        examples: ``build_example`` outputs, in the data's order.
        pad_id: the token that fills a window's end (never trained; the tokenizer's pad, else eos).
        overlong: "truncate" or "drop" an example longer than ``seq_len``.

    Raises:
        ValueError: see ``plan_packing``.
    """
    plan = plan_packing(examples, seq_len=seq_len, overlong=overlong)
    windows = [build_window(plan, w, seq_len=seq_len, pad_id=pad_id) for w in range(len(plan.windows))]
    return windows, plan.stats


class PackedDocs(NamedTuple):
    """What a fine-tuning loader yields beside (inputs, labels) for one micro-batch of packed windows:
    the ids and positions the block-causal mask and RoPE take (``features.documents.feed``), each
    window's real (non-padding) token count, and image-text data's images (else None)."""

    doc_ids: torch.Tensor  # (bs, seq_len) int64
    positions: torch.Tensor  # (bs, seq_len) int64
    real_tokens: torch.Tensor  # (bs,) int64
    images: Any = None  # models.qwen3_5.multimodal.ImageBatch: the windows' images (datasets/vision/loader.py)

    def to(self, device: torch.device) -> PackedDocs:
        return PackedDocs(*(t.to(device) if t is not None else None for t in self))


def windows_to_tensors(windows: Sequence[PackedWindow]) -> dict[str, torch.Tensor]:
    """Stack windows into (n_windows, seq_len) int64 tensors: inputs, labels, doc_ids, positions."""
    return {
        "inputs": torch.tensor([w.tokens for w in windows], dtype=torch.int64),
        "labels": torch.tensor([w.labels for w in windows], dtype=torch.int64),
        "doc_ids": torch.tensor([w.doc_ids for w in windows], dtype=torch.int64),
        "positions": torch.tensor([w.positions for w in windows], dtype=torch.int64),
    }
