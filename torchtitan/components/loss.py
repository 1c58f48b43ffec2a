"""The losses: plain cross-entropy, and cross-entropy over the output projection a chunk of sequence positions at a time.

The full logits (bs, seqlen, vocab) in fp32 are usually the largest activation of a small-dim,
large-vocab model: 4 bytes x tokens x vocab, and the loss's backward holds about three such
tensors (logits, log-softmax, their gradient). Here each chunk's logits are computed, reduced to a
summed loss and dropped; ``torch.utils.checkpoint`` recomputes them in backward, one chunk at a
time. Cost: one extra output matmul per chunk in backward.

Layouts:
* plain ``output.weight`` (single device, DDP, FSDP2: after the root's forward FSDP2 keeps the
  root's parameters, ``output`` included, unsharded until its post-backward reduce-scatter), so
  ``output(hidden_chunk)`` computes ordinary logits.
* ``output.weight`` a DTensor Shard(0) over the vocabulary (tensor parallel, ColwiseParallel):
  ``hidden`` is brought to Replicate once (it is dim/vocab the size of the logits), and each chunk's
  logits are this rank's vocab slice, wrapped as a DTensor Shard(1) for cross-entropy. Under
  ``loss_parallel()`` that is torch's vocab-parallel cross-entropy (the full logits never exist on
  one rank); without it DTensor gathers each chunk's logits, which is correct, just more traffic.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    output: nn.Linear,
    labels: torch.Tensor,
    *,
    chunk_size: int,
    reduction: Literal["mean", "sum"] = "mean",
    ignore_index: int = -100,
) -> torch.Tensor:
    """``F.cross_entropy(output(hidden).flatten(0, 1).float(), labels.flatten(0, 1))`` without all the logits.

    Args:
        hidden: (bs, seqlen, dim), the normed hidden state (``model(tokens, return_hidden=True)``).
        labels: (bs, seqlen) class indices; ``ignore_index`` positions count neither in the sum nor
            in the mean's denominator.
        chunk_size: sequence positions per chunk; 0 (or >= seqlen) = one chunk, not recomputed.
    """
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0 = one chunk), got {chunk_size}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction = {reduction!r}: allowed are 'mean', 'sum'")
    if isinstance(output.weight, DTensor):
        hidden, chunk_loss = _vocab_sharded(hidden, output.weight, ignore_index)
    else:
        chunk_loss = functools.partial(_chunk_loss, output, ignore_index=ignore_index)
    seqlen = hidden.shape[1]
    if chunk_size == 0 or chunk_size >= seqlen:
        total = chunk_loss(hidden, labels)
    else:
        total = sum(
            checkpoint(chunk_loss, hidden[:, s : s + chunk_size], labels[:, s : s + chunk_size], use_reentrant=False)
            for s in range(0, seqlen, chunk_size)
        )
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum()  # mean over the counted tokens, as F.cross_entropy


def _chunk_loss(output: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, ignore_index: int) -> torch.Tensor:
    """Summed loss of one chunk: hidden (bs, chunk, dim), labels (bs, chunk)."""
    logits = output(hidden).flatten(0, 1).float()  # (bs * chunk, vocab)
    return F.cross_entropy(logits, labels.flatten(0, 1), reduction="sum", ignore_index=ignore_index)


def _vocab_sharded(hidden: torch.Tensor, weight: DTensor, ignore_index: int):
    """(replicated local hidden, chunk-loss function) for a vocab-sharded output weight."""
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements != (Shard(0),):
        raise NotImplementedError(
            f"chunked cross-entropy supports an output weight sharded over the vocabulary on one mesh axis "
            f"(tensor parallel), got placements {weight.placements} on a {mesh.ndim}-D mesh"
        )
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    # Each rank's logits cover only its vocab slice, so its gradient w.r.t. hidden is a partial
    # sum: Partial makes backward reduce it (reduce-scatter back to Shard(1) under sequence parallel).
    hidden = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])  # (bs, seqlen, dim)
    # The local weight's gradient is complete for its rows: to_local keeps Shard(0) for it.
    local_weight = weight.to_local()  # (vocab / tp, dim)

    def chunk_loss(h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, local_weight).flatten(0, 1).float()  # (bs * chunk, vocab / tp)
        logits = DTensor.from_local(logits, mesh, [Shard(1)], run_check=False)
        # Labels are the same on every TP rank; a Replicate DTensor works with or without loss_parallel.
        target = DTensor.from_local(labels.flatten(0, 1), mesh, [Replicate()], run_check=False)
        return F.cross_entropy(logits, target, reduction="sum", ignore_index=ignore_index)

    return hidden, chunk_loss


def cross_entropy_loss(
    pred: torch.Tensor, labels: torch.Tensor, reduction: Literal["mean", "sum"] = "mean"
) -> torch.Tensor:
    """Mean (or summed) token loss over labels that are not -100; logits are upcast to fp32 so a bf16
    forward still gets an accurate loss."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction=reduction)


LossFn = Callable[..., torch.Tensor]  # cross_entropy_loss's signature: (pred, labels, reduction="mean")


def build_loss_fn(*, compile: bool) -> LossFn:
    """``cross_entropy_loss``, or (``training.compile_loss``) it under ``torch.compile``: the upcast and the
    log-softmax fuse into one kernel, so the fp32 copies of the logits are not all held at once. Each
    reduction compiles its own graph, once."""
    if not compile:
        return cross_entropy_loss
    logger.info("compiling the loss (training.compile_loss): cross-entropy under torch.compile")
    return torch.compile(cross_entropy_loss)
