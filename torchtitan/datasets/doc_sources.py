"""Document access by global index for the stream-based data pipeline.

The pipeline asks for "global document g" (g grows without bound; document g is row g mod N of
the dataset, so the data loops). Two implementations behind one interface:
- `MapSource`: random access into a map-style HF dataset (local files); a stream touches only
  its own rows.
- `StreamingSource`: one pass-through iterator over an iterable (streaming) HF dataset. Documents
  are read in order and queued for the stream that owns them (g mod num_streams); those owned by
  other ranks are read and dropped, so every rank reads the whole stream from the hub.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping

from datasets import Dataset, IterableDataset


class MapSource:
    """Random access by index into a map-style dataset."""

    def __init__(self, data: Dataset, text_field: str) -> None:
        self._data = data
        self._field = text_field
        self.num_docs: int | None = len(data)

    def reset(self, next_docs: Mapping[int, int]) -> None:
        """Nothing to rewind: access is by index."""

    def fetch(self, stream_id: int, g: int) -> str:
        assert self.num_docs, "fetch from an empty dataset"
        return self._data[g % self.num_docs][self._field]

    def iter_texts(self) -> Iterator[str]:
        """All documents once, in order."""
        for i in range(len(self._data)):
            yield self._data[i][self._field]


class StreamingSource:
    """Shared in-order iterator over a streaming dataset, demultiplexed into per-stream queues.

    Memory: a queue holds the documents its stream will need next, read early because a sibling
    stream needed a later document. Streams advance by the same number of tokens per step, so the
    queues stay short (a few documents each).
    """

    def __init__(self, data: IterableDataset, text_field: str, num_streams: int) -> None:
        self._data = data
        self._field = text_field
        self._num_streams = num_streams
        self.num_docs: int | None = None  # learnt at the first end of the data
        self._queues: dict[int, deque[tuple[int, str]]] = {}
        self._next_to_queue: dict[int, int] = {}
        self._docs: Iterator[tuple[int, str]] | None = None

    def reset(self, next_docs: Mapping[int, int]) -> None:
        """Restart reading so that stream s next receives global document `next_docs[s]`."""
        self._queues = {s: deque() for s in next_docs}
        self._next_to_queue = dict(next_docs)
        self._docs = None

    def fetch(self, stream_id: int, g: int) -> str:
        queue = self._queues[stream_id]
        while not queue:
            self._pull_one()
        got, text = queue.popleft()
        assert got == g, f"stream {stream_id} expected document {g}, queued {got}"
        return text

    def iter_texts(self) -> Iterator[str]:
        for row in self._data:
            yield row[self._field]

    def _pull_one(self) -> None:
        if self._docs is None:
            self._docs = self._global_docs(min(self._next_to_queue.values()))
        g, text = next(self._docs)
        owner = g % self._num_streams
        # drop documents of other ranks' streams, and ones this stream consumed before a resume
        if self._next_to_queue.get(owner) == g:
            self._queues[owner].append((g, text))
            self._next_to_queue[owner] += self._num_streams

    def _global_docs(self, start: int) -> Iterator[tuple[int, str]]:
        """Yield (g, text) for g = start, start + 1, ..., looping over the data forever."""
        g = start
        while True:
            offset = g if self.num_docs is None else g % self.num_docs
            rows = self._data.skip(offset) if offset else self._data
            read = 0
            for row in rows:
                yield g, row[self._field]
                g += 1
                read += 1
            if self.num_docs is None:
                # resumed past the end of an unknown-length stream: count it, then wrap properly
                self.num_docs = offset + read if read else sum(1 for _ in self._data)
            if self.num_docs == 0:
                raise ValueError("streaming dataset has no documents; check the dataset name/path")
