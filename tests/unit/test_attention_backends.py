"""Block-causal attention backends (torchtitan/models/common/attention.py) against SDPA with the boolean mask.

Tolerances are fp32's: outputs within rtol 1e-5 / atol 1e-5 and gradients within rtol 1e-4 /
atol 1e-5 of the masked SDPA (the kernels sum the same products in another order).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention.flex_attention import flex_attention

from torchtitan.build import build_model_args
from torchtitan.config.manager import JobConfig
from torchtitan.config.schema import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.common.attention import (
    build_document_block_mask,
    document_lengths,
    masked_attention,
    resolve_attention_backend,
    split_attention,
)
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.spec import get_model_spec

FWD = {"rtol": 1e-5, "atol": 1e-5}
GRAD = {"rtol": 1e-4, "atol": 1e-5}
# Each row its own layout: one-token documents, a whole-row document, a document cut at the end.
LAYOUTS = [[5, 1, 20, 1, 13], [40], [1, 1, 30, 8]]


def _doc_ids(layouts: list[list[int]]) -> torch.Tensor:
    """(bs, seqlen) document index from per-row document lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in layouts])


def _qkv(bs: int, seqlen: int, n_heads: int, n_kv_heads: int, head_dim: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(bs, n_heads, seqlen, head_dim)] + [(bs, n_kv_heads, seqlen, head_dim)] * 2
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def test_document_lengths_per_row():
    ids = _doc_ids([[3, 1], [4], [2, 2]])
    assert document_lengths(ids) == [3, 1, 4, 2, 2]  # row 1's only document does not merge into row 0's last


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_split_equals_masked_sdpa_forward_and_grads(n_kv_heads):
    ids = _doc_ids(LAYOUTS)
    q, k, v = _qkv(len(LAYOUTS), ids.shape[1], 4, n_kv_heads)
    ref = masked_attention(q, k, v, ids)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    out = split_attention(q, k, v, document_lengths(ids))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, **FWD)
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, **GRAD, msg=name)


def test_flex_forward_equals_masked_sdpa_on_cpu():
    """Eager FlexAttention forward (CPU has no FlexAttention backward) with the batch's block mask."""
    layouts = [[100, 3, 97], [1, 150, 49]]  # several 128-blocks, partly and fully masked ones
    ids = _doc_ids(layouts)
    q, k, v = (t.detach() for t in _qkv(2, ids.shape[1], 4, 2))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile.*")  # eager: the reference math
        out = flex_attention(q, k, v, block_mask=build_document_block_mask(ids), enable_gqa=True)
    torch.testing.assert_close(out, masked_attention(q, k, v, ids), **FWD)


def _model(n_layers: int = 3) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=61, max_seq_len=40))
    model.init_weights()
    return model


@pytest.mark.parametrize("ac", ["none", "full", "op"])
def test_layout_is_computed_once_per_batch(ac):
    """One layout per doc_ids object across layers and activation-checkpoint recompute; a new batch recomputes."""
    model = _model()
    if ac != "none":
        apply_ac(model, ActivationCheckpoint(mode="full" if ac == "full" else "selective", selective_ac_option="op"))
    tokens, ids = torch.randint(0, 61, (3, 40)), _doc_ids(LAYOUTS)
    model(tokens, doc_ids=ids).sum().backward()
    assert model.document_cache.num_computed == 1
    model(tokens, doc_ids=ids)
    assert model.document_cache.num_computed == 1
    model(tokens, doc_ids=ids.clone())  # equal values, another batch's tensor
    assert model.document_cache.num_computed == 2
    ids[:, -1] = 9  # edited in place: its version counter moves
    model(tokens, doc_ids=ids)
    assert model.document_cache.num_computed == 3


def test_interleaved_micro_batches_under_op_level_ac():
    """A pipeline schedule's order: two micro-batches' forwards, then their backwards. Each backward's recompute
    finds its own batch's layout (computing it again would run ops op-level AC did not record: it raises)."""
    model = _model()
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"))
    tokens, ids = torch.randint(0, 61, (3, 40)), _doc_ids(LAYOUTS)
    first, second = model(tokens, doc_ids=ids).sum(), model(tokens, doc_ids=ids.clone()).sum()
    first.backward()
    second.backward()
    assert model.document_cache.num_computed == 2


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_fake_tensor_forward_and_backward(backend):
    """The memory estimator's run: fake tensors, whose ids cannot be read, go through a stand-in."""
    with FakeTensorMode():
        model = Transformer(
            ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, attention_backend=backend)
        )
        tokens, ids = torch.randint(0, 61, (2, 40)), torch.zeros(2, 40, dtype=torch.long)
        out = model(tokens, doc_ids=ids)
        out.sum().backward()
    assert out.shape == (2, 40, 61)
    assert model.document_cache.num_computed == 0


def test_resolve_attention_backend():
    assert resolve_attention_backend("auto", "cpu") == "sdpa"
    assert resolve_attention_backend("auto", "cuda") == "flex"
    assert resolve_attention_backend("sdpa", "cuda") == "sdpa"
    assert resolve_attention_backend("flex", "cuda") == "flex"
    with pytest.raises(ValueError, match="'flex' needs CUDA: torch 2.13 has no FlexAttention backward on CPU"):
        resolve_attention_backend("flex", "cpu")
    with pytest.raises(ValueError, match="allowed are 'auto', 'sdpa', 'flex'"):
        resolve_attention_backend("xformers", "cuda")


def test_build_model_args_resolves_the_backend_from_the_device():
    config = JobConfig.parse_args(["--model.attention_backend", "auto"])
    spec = get_model_spec(config.model.name)
    assert build_model_args(config, spec, 256, device_type="cuda").attention_backend == "flex"
    assert build_model_args(config, spec, 256, device_type="cpu").attention_backend == "sdpa"
    config = JobConfig.parse_args(["--model.attention_backend", "flex"])
    with pytest.raises(ValueError, match="needs CUDA"):
        build_model_args(config, spec, 256, device_type="cpu")
