"""Documents inside packed windows: ``model.attn_mask_type = "block_causal"``.

The loader packs tokenized documents back to back (each ``[bos] text eos``) into ``seq_len``
windows. Boundaries are read from the tokens: a document ends with (and includes) its EOS token,
and the next token starts a new one; the window's first token starts one too (a document cut by the
previous window continues as a document of its own). EOS and not BOS, because every tokenizer here
has an EOS and Qwen3's has no BOS. Reading the tokens (rather than ids the loader would emit) keeps
the loader, its checkpointed state and the data order unchanged: the ids are a function of the
window, whatever the layout.

Per window: ``doc_ids`` (bs, seqlen) int64, the document index of each token (0, 1, ...);
``doc_positions`` (bs, seqlen), each token's position inside its document (RoPE restarts at every
document with ``model.positions_per_document``).

Loss: under block_causal the label at each EOS input (the next document's first token, predicted
from the previous document) is ``ignore_index``: with the documents masked from each other no
context could predict it. Under ``causal`` (the default, today's behaviour) labels are unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

IGNORE_INDEX = -100  # torch's cross_entropy default; chunked_cross_entropy's too


def document_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(bs, seqlen) token ids -> (bs, seqlen) int64 document index: the count of EOS tokens before each token."""
    ends = (inputs == eos_id).long()
    return ends.cumsum(dim=1) - ends  # exclusive: an EOS belongs to the document it ends


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(bs, seqlen) document index -> each token's position inside its document (0 at every start)."""
    seqlen = doc_ids.shape[1]
    index = torch.arange(seqlen, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index


def mask_boundary_labels(inputs: torch.Tensor, labels: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Labels with ``IGNORE_INDEX`` where the input is EOS (the label is the next document's first token)."""
    return labels.masked_fill(inputs == eos_id, IGNORE_INDEX)


def block_causal_mask(
    q_doc: torch.Tensor, k_doc: torch.Tensor, q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None
) -> torch.Tensor:
    """(bs, 1, sq, sk) bool, True = visible: same document and not in the future.

    q_doc (bs, sq), k_doc (bs, sk) document ids; q_pos (sq,), k_pos (sk,) the tokens' positions in
    the window (default 0..s-1, queries and keys of the same span).
    """
    sq, sk = q_doc.shape[1], k_doc.shape[1]
    q_pos = torch.arange(sq, device=q_doc.device) if q_pos is None else q_pos
    k_pos = torch.arange(sk, device=q_doc.device) if k_pos is None else k_pos
    causal = q_pos[:, None] >= k_pos[None, :]  # (sq, sk)
    same = q_doc[:, :, None] == k_doc[:, None, :]  # (bs, sq, sk)
    return (same & causal).unsqueeze(1)


def document_stats(doc_ids: torch.Tensor) -> torch.Tensor:
    """(bs, seqlen) document index -> (3,) int64 on its device: windows, documents, and the (query, key)
    pairs block-causal attention computes (sum over documents of n(n+1)/2). No host sync."""
    bs, seqlen = doc_ids.shape
    lengths = torch.zeros(bs, seqlen, dtype=torch.int64, device=doc_ids.device)
    lengths.scatter_add_(1, doc_ids, torch.ones_like(doc_ids))  # (bs, seqlen): tokens of document i of each row
    pairs = (lengths * (lengths + 1) // 2).sum()
    documents = (doc_ids[:, -1] + 1).sum()  # ids count up from 0 in each row
    return torch.stack([torch.tensor(bs, device=doc_ids.device), documents, pairs])


class DocumentStats(NamedTuple):
    """A training window of steps' documents, summed over the data-parallel (and CP) group: windows,
    documents, the (query, key) pairs block-causal attention computes, real (non-padding) tokens, and
    trained tokens (labels not ignored); image-text batches: the vision tower's patches and the (query, key) pairs
    its attention computes (each frame attends to itself). CP ranks count their dp rank's windows each (see
    take_stats)."""

    windows: int
    documents: int
    pairs: int
    tokens: int
    trained: int
    patches: int = 0
    patch_pairs: int = 0
