"""Chunked cross-entropy: parity with F.cross_entropy on the full logits, and its peak memory; the compiled loss
(training.compile_loss) is the one seam's choice, and not with chunks."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchtitan.components.loss import chunked_cross_entropy
from torchtitan.models.llama.model import ModelArgs, Transformer

BS, SEQ, DIM, VOCAB = 2, 24, 16, 50
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32: only the summation order differs (per-chunk sums, then their sum)


def _inputs(ignore: bool):
    g = torch.Generator().manual_seed(0)
    output = nn.Linear(DIM, VOCAB, bias=False)
    with torch.no_grad():
        output.weight.copy_(torch.randn(VOCAB, DIM, generator=g) * 0.3)
    hidden = torch.randn(BS, SEQ, DIM, generator=g, requires_grad=True)
    labels = torch.randint(0, VOCAB, (BS, SEQ), generator=g)
    if ignore:
        labels[0, :5] = -100
        labels[1, 17:] = -100
    return hidden, output, labels


def _loss_and_grads(loss_fn, ignore: bool):
    hidden, output, labels = _inputs(ignore)
    loss = loss_fn(hidden, output, labels)
    loss.backward()
    return loss.detach(), hidden.grad, output.weight.grad


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore", [False, True])
@pytest.mark.parametrize("chunk_size", [0, 1, 5, 8, 24, 100])  # 5 does not divide 24
def test_matches_full_cross_entropy(reduction, ignore, chunk_size):
    def reference(hidden, output, labels):
        return F.cross_entropy(output(hidden).flatten(0, 1).float(), labels.flatten(0, 1), reduction=reduction)

    def chunked(hidden, output, labels):
        return chunked_cross_entropy(hidden, output, labels, chunk_size=chunk_size, reduction=reduction)

    for got, want, name in zip(
        _loss_and_grads(chunked, ignore),
        _loss_and_grads(reference, ignore),
        ("loss", "hidden.grad", "output.weight.grad"),
    ):
        torch.testing.assert_close(got, want, **TOL, msg=name)


def test_custom_ignore_index_and_errors():
    hidden, output, labels = _inputs(ignore=False)
    labels[:, ::3] = 7
    want = F.cross_entropy(output(hidden).flatten(0, 1), labels.flatten(), ignore_index=7)
    got = chunked_cross_entropy(hidden, output, labels, chunk_size=4, ignore_index=7)
    torch.testing.assert_close(got, want, **TOL)
    with pytest.raises(ValueError, match="chunk_size must be >= 0"):
        chunked_cross_entropy(hidden, output, labels, chunk_size=-1)
    with pytest.raises(ValueError, match="reduction = 'none'"):
        chunked_cross_entropy(hidden, output, labels, chunk_size=4, reduction="none")


def test_model_return_hidden_feeds_the_chunked_loss():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64, max_seq_len=16))
    model.init_weights()
    tokens = torch.randint(0, 64, (2, 16))
    hidden = model(tokens, return_hidden=True)
    assert hidden.shape == (2, 16, 32)
    torch.testing.assert_close(model.output(hidden), model(tokens), rtol=0, atol=0)
    loss = chunked_cross_entropy(hidden, model.output, tokens, chunk_size=5)
    torch.testing.assert_close(loss, F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()), **TOL)


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages allocated inside the mode and still alive (CPU has no allocator stats)."""

    def __init__(self):
        super().__init__()
        self.current = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self._seen:
                storage = t.untyped_storage()
                self._seen.add(storage._cdata)
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, storage._cdata, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.current -= nbytes


def _peak_bytes(chunk_size: int) -> int:
    """Peak live bytes allocated by the loss's forward + backward (the inputs and weight not counted)."""
    vocab, bs, seq, dim = 8192, 2, 512, 64
    torch.manual_seed(0)
    output = nn.Linear(dim, vocab, bias=False)
    hidden = torch.randn(bs, seq, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (bs, seq))
    with _LiveBytes() as mem:
        if chunk_size:
            loss = chunked_cross_entropy(hidden, output, labels, chunk_size=chunk_size)
        else:
            loss = F.cross_entropy(output(hidden).flatten(0, 1).float(), labels.flatten(0, 1))
        loss.backward()
        del loss
    return mem.peak


def test_chunked_loss_peak_memory_is_at_most_half():
    plain, chunked = _peak_bytes(0), _peak_bytes(64)
    print(
        f"loss fwd+bwd peak, vocab 8192, bs 2, seq 512, dim 64: plain {plain / 2**20:.1f} MiB, "
        f"chunk 64 {chunked / 2**20:.1f} MiB ({chunked / plain:.2f}x)"
    )
    # The full fp32 logits are 32 MiB and backward holds about three of them; a 64-position chunk
    # is 4 MiB, plus the weight's gradient (2 MiB) and hidden's gradient per chunk (0.25 MiB).
    assert chunked <= 0.5 * plain


def test_config_rejects_negative_chunk_and_pipeline_parallel():
    from torchtitan.config.errors import ConfigError
    from torchtitan.config.manager import JobConfig
    from torchtitan.preflight import run_preflight

    with pytest.raises(ConfigError, match=r"training.loss_chunk_size must be >= 0 .*got -2"):
        run_preflight(JobConfig.parse_args(["--training.loss_chunk_size", "-2"]), 1)
    config = JobConfig.parse_args(["--training.loss_chunk_size", "64", "--experimental.pipeline_parallel_degree", "2"])
    with pytest.raises(NotImplementedError, match=r"training.loss_chunk_size = 64 with .*pipeline_parallel_degree = 2"):
        run_preflight(config, 2)


def test_compile_loss_is_the_loss_under_torch_compile_and_not_with_chunks():
    """Only the choice: compiling costs ~30 s cold on 2 cores, so its value is checked through the trainer, in the
    matrix row fsdp2_compile (loss parity with one process, RTOL 1e-5; tests/runs/training/test_parity_matrix.py)."""
    from torchtitan.components.loss import build_loss_fn, cross_entropy_loss
    from torchtitan.config.manager import JobConfig
    from torchtitan.preflight import run_preflight

    assert build_loss_fn(compile=False) is cross_entropy_loss
    compiled = build_loss_fn(compile=True)  # torch.compile is lazy: nothing compiles until it is called
    assert compiled is not cross_entropy_loss and compiled._torchdynamo_orig_callable is cross_entropy_loss
    config = JobConfig.parse_args(["--training.compile_loss", "--training.loss_chunk_size", "64"])
    with pytest.raises(NotImplementedError, match=r"compile_loss = true with training.loss_chunk_size = 64"):
        run_preflight(config, 1)
