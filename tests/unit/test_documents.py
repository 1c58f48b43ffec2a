"""Block-causal attention over packed documents (model.attn_mask_type = "block_causal").

The invariant: in a window packing documents d1..dk, each token's loss with block_causal equals its
loss when its document runs alone (causal; positions as configured), forward and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.common.documents import (
    IGNORE_INDEX,
    block_causal_mask,
    document_ids,
    document_positions,
    document_stats,
    mask_boundary_labels,
)
from torchtitan.models.llama.model import ModelArgs, Transformer

EOS = 1
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=64)


def test_ids_positions_labels_and_mask():
    inputs = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9, 10]])
    ids = document_ids(inputs, EOS)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]  # an EOS belongs to the document it ends
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    labels = torch.tensor([[6, EOS, 7, EOS, 8, 9, 10, 11]])
    assert mask_boundary_labels(inputs, labels, EOS).tolist() == [[6, EOS, IGNORE_INDEX, EOS, IGNORE_INDEX, 9, 10, 11]]
    mask = block_causal_mask(ids, ids)[0, 0]
    assert mask[3].tolist() == [False, False, False, True, False, False, False, False]
    assert mask[7].tolist() == [False] * 5 + [True] * 3
    # windows, documents, visible pairs (3 + 2 + 3 tokens: 6 + 3 + 6 pairs)
    assert document_stats(ids).tolist() == [1, 3, 6 + 3 + 6]
    two = torch.cat([ids, torch.zeros_like(ids)])  # a second row holding one document of 8
    assert document_stats(two).tolist() == [2, 4, 15 + 36]


def _window(lengths: list[int], seed: int = 0) -> torch.Tensor:
    """Documents of random non-EOS tokens, each ending with EOS, packed into one row of sum(lengths) + 1."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(2, ARGS.vocab_size, (n - 1,), generator=g), torch.tensor([EOS])]) for n in lengths]
    return torch.cat([*docs, torch.randint(2, ARGS.vocab_size, (1,), generator=g)])[None]


@pytest.mark.parametrize("per_document", [False, True], ids=["window-positions", "document-positions"])
def test_packed_losses_and_grads_equal_each_document_alone(per_document):
    lengths = [5, 11, 1, 9, 6]  # a one-token document (just EOS) too
    window = _window(lengths)
    inputs, labels = window[:, :-1], window[:, 1:]
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()

    ids = document_ids(inputs, EOS)
    positions = document_positions(ids) if per_document else None
    targets = mask_boundary_labels(inputs, labels, EOS)
    logits = model(inputs, positions, doc_ids=ids)
    # the default backend ran: one causal SDPA call per document, lengths read once for all layers
    assert ARGS.attention_backend == "sdpa" and model.document_cache.num_computed == 1
    packed = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")  # 0 where ignored
    packed.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    alone = torch.zeros_like(packed)
    start = 0
    for n in lengths:
        span = slice(start, start + n)
        pos = torch.arange(n) if per_document else torch.arange(start, start + n)
        out = model(inputs[:, span], pos)
        loss = F.cross_entropy(out.flatten(0, 1), targets[:, span].flatten(), reduction="none")
        alone[span] = loss.detach()
        loss.sum().backward()
        start += n

    torch.testing.assert_close(packed.detach(), alone, rtol=1e-5, atol=1e-6)
    assert (targets == IGNORE_INDEX).sum() == len(lengths)  # each document's EOS: its label is not learned
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_causal_is_unchanged_without_documents():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    window = _window([7, 9])
    inputs = window[:, :-1]
    one_doc = torch.zeros_like(inputs)  # every token in document 0: block_causal = causal
    torch.testing.assert_close(model(inputs, doc_ids=one_doc), model(inputs), rtol=1e-5, atol=1e-6)
