"""The fine-tuning data loader: rows -> tokenized examples -> per-epoch shuffle and packing -> the
windows of each global batch, the same whatever the parallel layout.

Invariant (as pre-training's, ``hf_datasets.py``): the global batch of step k holds windows
k*S .. k*S + S - 1 of one window sequence (S = num_streams = dp_degree x local batch x accumulation
steps). Window w is window w mod W of epoch w // W, where W is the windows per epoch: first-fit
decreasing depends only on the sorted example lengths, so W is the same every epoch. Epoch e shuffles
the examples with the seed (seed, e) before packing and shuffles its windows after, so every epoch
meets the examples in a new order and new company. Stream s (one row of the global batch) reads
windows s, s + S, s + 2S, ...; its state is how many it has read, so a checkpoint resumes on the same
next window under any data-parallel layout (``merge_data_states`` joins the ranks' states).

The rows are tokenized once per data + template + tokenizer (the first rank to need them, under a file lock)
and cached beside the data (datasets/sft/cache.py); every rank then reads the examples and plans the same
packing (no communication); an epoch's plan holds example indices, and windows are built as they are read.
"""

from __future__ import annotations

import logging
import random
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from datasets import Dataset, load_dataset
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.datasets.hf_datasets import first_group, validate_groups
from torchtitan.datasets.local_files import source_files
from torchtitan.datasets.registry import get_spec, load_local, looks_like_hub_id
from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.datasets.sft.columns import ColumnMap
from torchtitan.datasets.sft.examples import build_example
from torchtitan.datasets.sft.packing import PackedDocs, PackingPlan, build_window, plan_packing

if TYPE_CHECKING:
    from torchtitan.datasets.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Example = tuple[Sequence[int], Sequence[int]]  # (tokens, labels), build_example's


@dataclass(frozen=True)
class RowSource:
    """One file's (or one cached HF dataset's) rows, and the name errors give it."""

    name: str
    rows: Dataset


def load_rows(dataset_name: str, dataset_path: str | None) -> list[RowSource]:
    """The rows of a registered dataset or of ``dataset_path``: a local .jsonl/.json/.parquet file, a folder
    of them (one source per file, so errors name the file), or the name of a dataset in the local HF cache.

    Raises:
        FileNotFoundError: a path that does not exist and is not a dataset name.
        ValueError: unreadable data (naming file and line), or a hub-only dataset without a local copy.
    """
    spec = get_spec(dataset_name)
    if dataset_path is not None:
        path = Path(dataset_path).expanduser()
        if path.exists():
            files = source_files(path) if path.is_dir() else [path]
            return [RowSource(str(f), load_local(f, None)) for f in files]
        if looks_like_hub_id(dataset_path):
            # fine-tuning reads every row up front: map-style, from the cache (HF_DATASETS_OFFLINE=1 works)
            return [RowSource(dataset_path, load_dataset(dataset_path, split="train"))]
        raise FileNotFoundError(
            f"dataset_path {dataset_path!r} does not exist; pass a .jsonl/.json/.parquet file or folder, or the "
            "name of a Hugging Face dataset in the local cache ('owner/name')"
        )
    if spec.default_path is None:
        raise ValueError(
            f"dataset {dataset_name!r} is streamed from the hub, and fine-tuning reads its rows up front; "
            "set dataset_path to a local copy"
        )
    return [RowSource(str(spec.default_path), load_local(spec.default_path, None))]


def _check_columns(source: RowSource, fmt: str, columns: ColumnMap) -> None:
    needed = [columns.messages] if fmt == "chat" else [columns.prompt, columns.completion]
    missing = [c for c in needed if c not in source.rows.column_names]
    if missing:
        raise ValueError(
            f"{source.name}: training.dataset_format = '{fmt}' reads the column(s) {needed}; the data has "
            f"{source.rows.column_names}; set dataset_format to the data's shape, or name its columns with "
            f"training.dataset_columns (e.g. ['{'messages' if fmt == 'chat' else 'prompt'}=<column>'])"
        )


def tokenize_rows(
    sources: Sequence[RowSource], tokenizer: ChatTokenizer, *, fmt: str, loss_on: str, columns: ColumnMap
) -> list[Example]:
    """Every row of ``sources`` as ``(tokens, labels)``, in order (compact int32 arrays).

    Raises:
        ValueError: one line naming the file and row of the first bad row (see ``build_example``).
    """
    examples: list[Example] = []
    for source in sources:
        _check_columns(source, fmt, columns)
        for i, row in enumerate(source.rows):
            tokens, labels = build_example(
                row, tokenizer, loss_on=loss_on, columns=columns, source=source.name, row_index=i
            )
            examples.append((array("i", tokens), array("i", labels)))
    if not examples:
        raise ValueError(f"{', '.join(s.name for s in sources)}: no rows to fine-tune on")
    return examples


def tokenize_cached(
    sources: Sequence[RowSource], chat: ChatTokenizer, *, fmt: str, loss_on: str, columns: ColumnMap
) -> list[Example]:
    """``tokenize_rows``'s examples, tokenized once per data + template + tokenizer and then read from the cache
    (datasets/sft/cache.py): one rank tokenizes, the others and later runs read its file."""
    from torchtitan.datasets.sft.cache import cache_folder, cache_key, cached_examples

    names = [s.name for s in sources]
    key = cache_key(
        names,
        [getattr(s.rows, "_fingerprint", "") for s in sources],  # a cached HF dataset's own content hash
        chat.base.path,
        template=chat.chat_template,  # None: the default template, which VERSION covers
        fmt=fmt,
        loss_on=loss_on,
        columns=repr(columns),
    )
    examples, _ = cached_examples(
        cache_folder(names[0]), key, lambda: tokenize_rows(sources, chat, fmt=fmt, loss_on=loss_on, columns=columns)
    )
    return examples


class SFTDataset(IterableDataset, Stateful):
    """Yields, forever, one micro-batch per stream group, groups in order each step:
    ``(inputs, labels, PackedDocs)``, each tensor (len(group), seq_len) (``real_tokens``: (len(group),))."""

    def __init__(
        self,
        name: str,
        examples: Sequence[Example],
        *,
        seq_len: int,
        pad_id: int,
        overlong: str,
        seed: int,
        stream_groups: list[list[int]],
        num_streams: int,
    ) -> None:
        validate_groups(stream_groups, num_streams)
        self.name, self._examples = name, examples
        self._seq_len, self._pad_id, self._overlong, self._seed = seq_len, pad_id, overlong, seed
        self._num_streams = num_streams
        self._groups = [list(g) for g in stream_groups]
        self._windows = {s: 0 for group in self._groups for s in group}  # windows read, per stream
        self._plans: dict[int, tuple[PackingPlan, list[int], list[int]]] = {}
        plan, _, _ = self._epoch(0)
        self.stats = plan.stats
        self.windows_per_epoch = plan.stats.windows
        if self.windows_per_epoch == 0:
            raise ValueError(
                f"{name}: all {len(examples)} examples are longer than seq_len = {seq_len} and none can be kept "
                f"(training.overlong_examples = '{overlong}'); raise seq_len or use 'truncate'"
            )
        self._fingerprint = [len(examples), plan.stats.tokens, plan.stats.trained_tokens]
        self._epoch_logged = -1

    def _epoch(self, epoch: int) -> tuple[PackingPlan, list[int], list[int]]:
        """Epoch ``epoch``'s packing plan (over its shuffled examples), its window order and its example order."""
        if epoch not in self._plans:
            rng = random.Random(f"sft-epoch:{self._seed}:{epoch}")  # str seeds: the same in every process
            order = list(range(len(self._examples)))
            rng.shuffle(order)
            plan = plan_packing([self._examples[i] for i in order], seq_len=self._seq_len, overlong=self._overlong)
            window_order = list(range(len(plan.windows)))
            rng.shuffle(window_order)
            if len(self._plans) >= 2:  # the epoch being read and the next are enough
                del self._plans[min(self._plans)]
            self._plans[epoch] = (plan, window_order, order)
        return self._plans[epoch]

    def window(self, index: int) -> tuple[list[int], list[int], list[int], list[int], int, list[int]]:
        """Global window ``index``: (tokens, labels, doc_ids, positions, real token count, its examples' indices in
        window order)."""
        epoch, i = divmod(index, self.windows_per_epoch)
        plan, window_order, order = self._epoch(epoch)
        assert len(plan.windows) == self.windows_per_epoch  # first-fit decreasing sees the same lengths
        if epoch > self._epoch_logged:
            self._epoch_logged = epoch
            logger.info("fine-tuning data %s: epoch %d (%d windows)", self.name, epoch, self.windows_per_epoch)
        built = build_window(plan, window_order[i], seq_len=self._seq_len, pad_id=self._pad_id)
        real = sum(len(plan.kept[m][0]) for m in built.examples)
        return built.tokens, built.labels, built.doc_ids, built.positions, real, [order[m] for m in built.examples]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, PackedDocs]]:
        first = self._first_group()
        while True:
            for group in self._groups[first:]:
                rows = [self.window(self._windows[s] * self._num_streams + s) for s in group]
                for s in group:
                    self._windows[s] += 1
                yield self.batch(rows)
            first = 0

    def batch(self, rows: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, PackedDocs]:
        """One micro-batch from its windows (``window``'s tuples): (len(group), seq_len) tensors each."""
        tokens, labels, doc_ids, positions = (torch.tensor([r[k] for r in rows]) for k in range(4))
        real = torch.tensor([r[4] for r in rows])
        return tokens, labels, PackedDocs(doc_ids, positions, real)

    def _first_group(self) -> int:
        return first_group([[self._windows[s] for s in group] for group in self._groups])

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "sft",
            "num_streams": self._num_streams,
            "seq_len": self._seq_len,
            "windows_per_epoch": self.windows_per_epoch,
            "examples": self._fingerprint,
            "streams": {str(s): {"windows": n} for s, n in self._windows.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's streams from a state that may hold other ranks' streams too."""
        if state_dict.get("kind") != "sft":
            raise ValueError(
                "the checkpoint's data state is pre-training text data; this run fine-tunes "
                "(training.dataset_format): start it from the weights only (checkpoint.initial_load_path)"
            )
        saved = (state_dict["num_streams"], state_dict["seq_len"])
        if saved != (self._num_streams, self._seq_len):
            raise ValueError(
                f"data state has (num_streams, seq_len) = {saved}, this run {(self._num_streams, self._seq_len)}; "
                f"keep the global batch size (dp * local_batch_size * grad_accum_steps) and seq_len to resume"
            )
        if (
            list(state_dict["examples"]) != self._fingerprint
            or state_dict["windows_per_epoch"] != self.windows_per_epoch
        ):
            raise ValueError(
                f"{self.name}: the checkpoint was fine-tuning other data (examples, tokens, trained tokens = "
                f"{list(state_dict['examples'])}, now {self._fingerprint}); resume with the same data, template "
                "and loss_on, or start from the weights only (checkpoint.initial_load_path)"
            )
        missing = [s for s in self._windows if str(s) not in state_dict["streams"]]
        if missing:
            raise ValueError(
                f"data state lacks streams {missing} owned by this rank; load the merged states of all ranks "
                f"(merge_data_states) when the data-parallel layout changed"
            )
        self._windows = {s: int(state_dict["streams"][str(s)]["windows"]) for s in self._windows}
        self._first_group()  # reject inconsistent states now rather than at the next batch


def chat_tokenizer(tokenizer: Tokenizer) -> ChatTokenizer:
    """The run's tokenizer with its chat template (Hugging Face tokenizers only)."""
    path = getattr(tokenizer, "path", None)
    if path is None:
        raise ValueError(
            f"fine-tuning data (training.dataset_format) needs a Hugging Face tokenizer (tokenizer.json and "
            f"tokenizer_config.json, with its chat template); got a {type(tokenizer).__name__}: set "
            "model.tokenizer_path to the model's tokenizer folder"
        )
    return ChatTokenizer(path, base=tokenizer)
