"""Stateful, parallel-layout-invariant text data pipeline.

Invariant: the samples of an optimizer step are a function of the *global* batch only, never of
how it is split over data-parallel ranks and gradient-accumulation micro-batches.

How: the global batch has `num_streams` rows (dp_degree * local_batch_size * grad_accum_steps).
Row/stream s reads global documents s, s + S, s + 2S, ... (S = num_streams; document g is row
g mod N of the dataset, so the data loops), tokenizes each with bos/eos, concatenates them into its
own token buffer and cuts non-overlapping windows of seq_len + 1 tokens (input = w[:-1],
label = w[1:]). Each step, every stream yields exactly one window. A rank owns some streams,
grouped into one group per micro-batch (`compute_stream_groups`); the state is kept per stream, so
a checkpoint can be loaded under a different dp degree by redistributing streams.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import Dataset
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.datasets.doc_sources import MapSource, StreamingSource
from torchtitan.datasets.registry import HFDataset, load_text_dataset
from torchtitan.datasets.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def compute_stream_groups(
    dp_rank: int, dp_degree: int, local_batch_size: int, grad_accum_steps: int
) -> list[list[int]]:
    """Streams of `dp_rank`, one group (micro-batch) per accumulation step.

    Rank r owns the contiguous streams [r*b*a, (r+1)*b*a), split into `a` groups of `b`
    (b = local_batch_size, a = grad_accum_steps): concatenating all groups of all ranks in rank
    order gives streams 0..S-1, the same global batch a 1-rank, 1-micro-batch run sees.
    """
    for name, value in (
        ("dp_degree", dp_degree),
        ("local_batch_size", local_batch_size),
        ("grad_accum_steps", grad_accum_steps),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank must be in [0, {dp_degree}) for dp_degree={dp_degree}, got {dp_rank}")
    first = dp_rank * local_batch_size * grad_accum_steps
    return [[first + i * local_batch_size + j for j in range(local_batch_size)] for i in range(grad_accum_steps)]


@dataclass
class _StreamState:
    docs: int = 0  # documents consumed: the next is global document s + docs * num_streams
    windows: int = 0  # windows yielded (one per optimizer step once the step completes)
    buffer: list[int] = field(default_factory=list)  # tokens read but not yet yielded


def validate_groups(stream_groups: list[list[int]], num_streams: int) -> None:
    flat = [s for group in stream_groups for s in group]
    if not stream_groups or any(not group for group in stream_groups):
        raise ValueError(
            f"stream_groups must be non-empty lists of stream ids, got {stream_groups}; "
            f"build them with compute_stream_groups"
        )
    if len(set(flat)) != len(flat) or not all(0 <= s < num_streams for s in flat):
        raise ValueError(f"stream_groups must hold distinct ids in [0, {num_streams}), got {stream_groups}")


def first_group(counts: list[list[int]]) -> int:
    """Index of the next group to yield, from the windows each group's streams have yielded: after a
    mid-step save, earlier groups are 1 window ahead.

    Raises:
        ValueError: the counts are not a step boundary or a prefix of one step.
    """
    low = min(min(c) for c in counts)
    per_group = [c[0] if len(set(c)) == 1 else None for c in counts]
    ahead = [c == low + 1 for c in per_group]
    # valid: each group uniform, and the groups one window ahead form a prefix
    if None in per_group or any(c not in (low, low + 1) for c in per_group) or ahead != sorted(ahead, reverse=True):
        raise ValueError(
            f"data state windows per group {counts} are not a step boundary or a prefix of one step; "
            f"change the parallel layout only with a state saved at an optimizer-step boundary"
        )
    return ahead.index(False)


def merge_data_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Union of several ranks' data-loader states, for loading under another dp degree.

    Raises:
        ValueError: the states disagree on num_streams/seq_len or on a shared stream.
    """
    if not states:
        raise ValueError("merge_data_states needs at least one state")
    # everything but the streams describes the whole run (fine-tuning's states add their data's fingerprint)
    merged = {**{k: v for k, v in states[0].items() if k != "streams"}, "streams": {}}
    for state in states:
        if (state["num_streams"], state["seq_len"]) != (merged["num_streams"], merged["seq_len"]):
            raise ValueError(
                f"cannot merge data states with different (num_streams, seq_len): "
                f"{(state['num_streams'], state['seq_len'])} vs "
                f"{(merged['num_streams'], merged['seq_len'])}"
            )
        differ = sorted(k for k in set(state) | set(merged) if k != "streams" and state.get(k) != merged.get(k))
        if differ:
            raise ValueError(f"cannot merge data states that differ in {differ}; they come from different runs")
        for sid, stream in state["streams"].items():
            if merged["streams"].setdefault(sid, stream) != stream:
                raise ValueError(f"data states disagree on stream {sid}; they come from different runs/steps")
    return merged


class HuggingFaceDataset(IterableDataset, Stateful):
    """Yields, forever, one (input, label) micro-batch per stream group, groups in order each step.

    Each micro-batch is a pair of LongTensors of shape (len(group), seq_len).
    """

    def __init__(
        self,
        dataset_name: str,
        data: HFDataset,
        text_field: str,
        tokenizer: Tokenizer,
        seq_len: int,
        stream_groups: list[list[int]],
        num_streams: int,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        validate_groups(stream_groups, num_streams)
        columns = data.column_names
        if columns is not None and text_field not in columns:
            raise ValueError(f"dataset {dataset_name!r} has no text field {text_field!r}; columns: {columns}")
        self.dataset_name = dataset_name
        self._tokenizer = tokenizer
        self._seq_len = seq_len
        self._num_streams = num_streams
        self._groups = [list(g) for g in stream_groups]
        self._source = (
            MapSource(data, text_field) if isinstance(data, Dataset) else StreamingSource(data, text_field, num_streams)
        )
        self._streams = {s: _StreamState() for group in self._groups for s in group}
        self._epoch_logged = 0
        self._check_enough_tokens()

    def _check_enough_tokens(self) -> None:
        # each stream eventually fills by looping, but a dataset smaller than one window would
        # repeat the same text in every sample: almost surely a wrong path, so refuse it
        need, total = self._seq_len + 1, 0
        for g, text in enumerate(self._source.iter_texts()):
            total += len(self._tokenizer.encode(self._checked(text, g), bos=True, eos=True))
            if total >= need:
                return
        raise ValueError(
            f"dataset {self.dataset_name!r} has {total} tokens in all, fewer than one sample of seq_len + 1 = "
            f"{need}; use more data or a smaller seq_len"
        )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._source.reset({s: s + st.docs * self._num_streams for s, st in self._streams.items()})
        first = self._first_group()
        while True:
            for group in self._groups[first:]:
                windows = torch.tensor([self._next_window(s) for s in group], dtype=torch.long)
                yield windows[:, :-1], windows[:, 1:]  # (len(group), seq_len) each
            first = 0

    def _next_window(self, stream_id: int) -> list[int]:
        st = self._streams[stream_id]
        while len(st.buffer) < self._seq_len + 1:
            g = stream_id + st.docs * self._num_streams
            text = self._checked(self._source.fetch(stream_id, g), g)
            self._log_epoch(g)
            st.buffer.extend(self._tokenizer.encode(text, bos=True, eos=True))
            st.docs += 1
        window = st.buffer[: self._seq_len + 1]
        del st.buffer[: self._seq_len + 1]
        st.windows += 1
        return window

    def _checked(self, text: object, g: int) -> str:
        # Local files are checked when loaded (local_files.py); a streamed row is seen only here.
        if not isinstance(text, str):
            row = g % self._source.num_docs if self._source.num_docs else g
            raise ValueError(
                f"dataset {self.dataset_name!r}, row {row}: the text is {'null' if text is None else type(text).__name__}"
                ", not a string; fix or drop that row"
            )
        return text

    def _log_epoch(self, g: int) -> None:
        num_docs = self._source.num_docs
        epoch = g // num_docs if num_docs else 0
        if epoch > self._epoch_logged:
            self._epoch_logged = epoch
            logger.warning("dataset %s: looping over the end (epoch %d)", self.dataset_name, epoch)

    def _first_group(self) -> int:
        return first_group([[self._streams[s].windows for s in group] for group in self._groups])

    def state_dict(self) -> dict[str, Any]:
        streams = {
            str(s): {"docs": st.docs, "windows": st.windows, "buffer": list(st.buffer)}
            for s, st in self._streams.items()
        }
        return {"num_streams": self._num_streams, "seq_len": self._seq_len, "streams": streams}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the streams this rank owns from a state that may also hold other ranks' streams."""
        if state_dict.get("kind") == "sft":
            raise ValueError(
                "the checkpoint's data state is fine-tuning data (training.dataset_format); this run reads text: "
                "start it from the weights only (checkpoint.initial_load_path)"
            )
        if state_dict.get("kind") == "indexed":
            raise ValueError(
                "the checkpoint's data state is indexed data or a blend (training.dataset_mix); this run reads text "
                'streams: resume with that data, or start the data over with checkpoint.exclude_from_loading = ["dataloader"]'
            )
        saved = (state_dict["num_streams"], state_dict["seq_len"])
        if saved != (self._num_streams, self._seq_len):
            raise ValueError(
                f"data state has (num_streams, seq_len) = {saved}, this run {(self._num_streams, self._seq_len)}; "
                f"keep the global batch size (dp * local_batch_size * grad_accum_steps) and seq_len to resume"
            )
        missing = [s for s in self._streams if str(s) not in state_dict["streams"]]
        if missing:
            raise ValueError(
                f"data state lacks streams {missing} owned by this rank; load the merged states of all ranks "
                f"(merge_data_states) when the data-parallel layout changed"
            )
        for s in self._streams:
            saved_stream = state_dict["streams"][str(s)]
            self._streams[s] = _StreamState(
                docs=int(saved_stream["docs"]),
                windows=int(saved_stream["windows"]),
                buffer=[int(t) for t in saved_stream["buffer"]],
            )
        self._first_group()  # reject inconsistent states now rather than at the next batch


class ParallelAwareDataloader(StatefulDataLoader):
    """Single-process loader over a `HuggingFaceDataset` (or the fine-tuning `SFTDataset`); its state is
    the dataset's per-stream state.

    Call `iter()` again after `load_state_dict`: iterators made before it are invalidated.
    """

    def __init__(self, dataset: IterableDataset) -> None:
        # torchdata 0.11's constructor calls the deprecated torch.set_vital; the warning is noise.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            super().__init__(dataset, batch_size=None, num_workers=0)

    def state_dict(self) -> dict[str, Any]:
        # with num_workers=0 the dataset object is the one being iterated: its state is exact,
        # and unlike the base loader's (sample counters, per rank) it merges across ranks
        return self.dataset.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state_dict)
        super().load_state_dict({})  # drop the live iterator; the next iter() reads the new state


def build_hf_data_loader(
    dataset_name: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    seq_len: int,
    stream_groups: list[list[int]],
    num_streams: int,
) -> ParallelAwareDataloader:
    """Build the data loader of one data-parallel rank over text streams (datasets/text_loader.py chooses it).

    Args:
        dataset_name: a registered name ("pydocs", "c4", "c4_test", "fineweb").
        dataset_path: local file/folder (or, for hub datasets, a hub id) overriding the source.
        stream_groups: this rank's streams, one group per micro-batch (`compute_stream_groups`).
        num_streams: global batch size in samples (dp_degree * local_batch_size * grad_accum_steps).
    """
    data, text_field = load_text_dataset(dataset_name, dataset_path)
    dataset = HuggingFaceDataset(dataset_name, data, text_field, tokenizer, seq_len, stream_groups, num_streams)
    return ParallelAwareDataloader(dataset)
