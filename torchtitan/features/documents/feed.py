"""Document masking in the trainer: from a packed batch to the ``doc_ids`` / ``positions`` every model
part's forward receives (``model.attn_mask_type = "block_causal"``; the mask itself and the
boundary rules are torchtitan/models/common/documents.py).

The batch is read before context parallel cuts it (a token's document depends on every EOS before it),
then its document ids and per-document positions are cut with the same positions as inputs and
labels. They reach the model the way CP's positions do (``parallelize.pass_positions``): a forward
pre-hook on each model part adds them as keyword arguments, never through a pipeline schedule's
hidden states. Under pipeline parallel each stage receives its micro-batches in order (every
schedule runs a stage's forwards in micro-batch order), so each stage's hook takes the next of the
batch's ``n_microbatches`` slices, split as the schedule splits the batch (``tensor_split`` on dim 0).
Inside a part the ids are a forward argument of every block, so activation checkpointing's
recompute sees the same mask.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.components.batch import Batch, Documents
from torchtitan.distributed.context_parallel.context_parallel import shard_sequence
from torchtitan.models.common.documents import (
    IGNORE_INDEX,
    DocumentStats,
    document_ids,
    document_positions,
    document_stats,
    mask_boundary_labels,
)

if TYPE_CHECKING:
    from torchtitan.config.schema import Model as ModelConfig
    from torchtitan.datasets.sft.packing import PackedDocs
    from torchtitan.distributed.pipeline.stages import ShapeInference


def batch_stats(doc_ids: torch.Tensor, labels: torch.Tensor, real_tokens: torch.Tensor | None) -> torch.Tensor:
    """(5,) int64, ``DocumentStats``' fields for one whole (bs, seqlen) batch. ``real_tokens`` (bs,): a
    packed fine-tuning batch's non-padding tokens per window (its padding, one document id at the end
    of a window, is neither a document nor attention work counted); None: no padding. No host sync."""
    stats = document_stats(doc_ids)  # windows, documents, pairs
    bs, seqlen = doc_ids.shape
    trained = (labels != IGNORE_INDEX).sum()
    if real_tokens is None:
        return torch.cat([stats, torch.stack([torch.tensor(bs * seqlen, device=stats.device), trained])])
    pad = seqlen - real_tokens  # (bs,)
    padded = torch.stack([torch.zeros_like(pad[0]), (pad > 0).sum(), (pad * (pad + 1) // 2).sum()])
    return torch.cat([stats - padded, torch.stack([real_tokens.sum(), trained])])


class DocumentFeed:
    """Builds each batch's ``Documents`` and feeds them to the model parts' forwards.

    Args:
        model_parts: the rank's parts (one, or its pipeline stages' modules).
        eos_id: the tokenizer's end-of-document token.
        positions_per_document: RoPE positions restart at every document.
        n_microbatches: the pipeline's micro-batches per batch, or 1 without pipeline parallel.
        shard: context parallel's cut of a (bs, seqlen) tensor to this rank's positions, or None.
        group: the data-parallel x CP group ``take_stats`` sums over, or None (one such rank).
        shape_inference: active while a pipeline stage runs its shape-inference forward (no documents then).
    """

    def __init__(
        self,
        model_parts: list[nn.Module],
        *,
        eos_id: int,
        positions_per_document: bool,
        n_microbatches: int = 1,
        shard: Callable[[torch.Tensor], torch.Tensor] | None = None,
        group: dist.ProcessGroup | None = None,
        shape_inference: ShapeInference,
    ):
        self.shape_inference = shape_inference
        self.eos_id, self.positions_per_document = eos_id, positions_per_document
        self.n_microbatches, self.shard = n_microbatches, shard
        self.queues: list[deque[Documents]] = [deque() for _ in model_parts]
        self.active = False
        self.causal = False  # inside ``plain_causal``: forwards get no documents
        self.stats: torch.Tensor | None = None  # see record / take_stats
        self.group = group  # the data-parallel x CP group the statistics are summed over
        for part, queue in zip(model_parts, self.queues):
            part.register_forward_pre_hook(self._hook(queue), with_kwargs=True)

    def prepare(
        self, inputs: torch.Tensor, labels: torch.Tensor, packed: PackedDocs | None = None
    ) -> tuple[torch.Tensor, Documents]:
        """Whole-sequence (bs, seqlen) inputs/labels -> the labels to train on and the batch's documents,
        cut for context parallel like the inputs will be.

        Pre-training text: documents end at each EOS, and the targets across a boundary are masked.
        ``packed`` (fine-tuning): the loader's ids and per-example positions are taken as they are;
        its labels already stop at each example's end.
        """
        if packed is None:
            ids = document_ids(inputs, self.eos_id)
            labels = mask_boundary_labels(inputs, labels, self.eos_id)
            positions = document_positions(ids) if self.positions_per_document else None
        else:
            ids = packed.doc_ids
            positions = packed.positions if self.positions_per_document else None
        stats = batch_stats(ids, labels, packed.real_tokens if packed is not None else None)
        grids = packed.images.grid_thw if packed is not None and packed.images is not None else ()
        # the tower's work (host ints, no sync): its patches and each frame's attention pairs (MFU's image term)
        tower = [sum(t * h * w for t, h, w in grids), sum(t * (h * w) ** 2 for t, h, w in grids)]
        stats = torch.cat([stats, torch.tensor(tower, dtype=stats.dtype, device=stats.device)])
        if self.shard is not None:
            ids = self.shard(ids)
            positions = self.shard(positions) if positions is not None else None
        return labels, Documents(ids, positions, stats, packed.images if packed is not None else None)

    def record(self, batches: list[Batch]) -> None:
        """Add a training step's batches to the statistics ``take_stats`` returns (validation's are not)."""
        for batch in batches:
            if batch.docs is not None and batch.docs.stats is not None:
                self.stats = batch.docs.stats if self.stats is None else self.stats + batch.docs.stats

    def take_stats(self) -> DocumentStats | None:
        """The statistics recorded since the last call, summed over the data-parallel
        (and CP) group: every rank of it must call this (the step metrics' log does). None without a record.

        CP ranks of one dp rank record the same whole windows, so the sum counts each window cp times:
        the ratios (documents per window, pairs per token) are those of the global batch.
        """
        if self.stats is None:
            return None
        if self.group is not None:
            dist.all_reduce(self.stats, group=self.group)
        stats = DocumentStats(*self.stats.tolist())
        self.stats = None
        return stats

    @contextlib.contextmanager
    def use(self, documents: Documents) -> Iterator[None]:
        """The forwards inside see ``documents``: each part's micro-batches in order."""
        pieces = documents.split(self.n_microbatches) if self.n_microbatches > 1 else [documents]
        for queue in self.queues:
            queue.clear()
            queue.extend(pieces)
        self.active = True
        try:
            yield
        finally:
            self.active = False
            for queue in self.queues:
                queue.clear()

    @contextlib.contextmanager
    def plain_causal(self) -> Iterator[None]:
        """The forwards inside run plain causal attention over each row (the in-loop evaluation's independent
        requests, torchtitan/features/in_loop_eval/loop.py), at positions 0..n-1 or those the caller passes."""
        self.causal = True
        try:
            yield
        finally:
            self.causal = False

    def _hook(self, queue: deque[Documents]) -> Callable:
        def add_documents(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if self.shape_inference.active or self.causal:
                return args, kwargs  # a pipeline stage's meta forward: shapes do not depend on the mask
            if not self.active:
                raise RuntimeError(
                    "model.attn_mask_type = 'block_causal': a forward ran without its batch's documents "
                    "(DocumentFeed.use); this is a trainer bug, not a configuration problem"
                )
            if not queue:
                raise RuntimeError(
                    f"model.attn_mask_type = 'block_causal': a model part ran more forwards than the "
                    f"{self.n_microbatches} micro-batch(es) of its batch"
                )
            docs = queue.popleft()
            extra = {"doc_ids": docs.doc_ids}
            if docs.positions is not None:
                extra["positions"] = docs.positions
            if docs.images is not None:
                extra["images"] = docs.images
            return args, {**kwargs, **extra}

        return add_documents


def build_document_feed(
    model_parts: list[nn.Module],
    *,
    model: ModelConfig,
    eos_id: int,
    n_microbatches: int,
    cp_positions: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    shape_inference: ShapeInference,
) -> DocumentFeed | None:
    """The feed for ``model.attn_mask_type = "block_causal"`` over ``model_parts``, else None.

    ``cp_positions``: context parallel's positions of this rank (it cuts the documents as the trainer
    cuts inputs), or None; the other arguments as ``DocumentFeed``'s.
    """
    if model.attn_mask_type != "block_causal":
        return None

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence([t], seq_dim=1, positions=cp_positions)[0]  # as the trainer cuts inputs

    return DocumentFeed(
        model_parts,
        eos_id=eos_id,
        positions_per_document=model.positions_per_document,
        n_microbatches=n_microbatches,
        shard=shard if cp_positions is not None else None,
        group=group,
        shape_inference=shape_inference,
    )
