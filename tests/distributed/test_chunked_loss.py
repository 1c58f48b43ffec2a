"""Chunked cross-entropy under TP + loss parallel, TP without it, and FSDP2, against the plain loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from tests.support.distributed import run_distributed
from torchtitan.build import build_model
from torchtitan.components.loss import chunked_cross_entropy
from torchtitan.config.manager import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import ModelArgs

pytestmark = [pytest.mark.distributed, pytest.mark.pool(2)]

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, multiple_of=32, max_seq_len=16)
BATCH, SEQ, CHUNK = 4, 16, 5  # 5 does not divide 16: the last chunk is short
# fp32 throughout; TP splits the vocab-dim reductions and FSDP averages gradients across ranks, so
# only summation order differs from the single-process reference.
TOL = dict(rtol=1e-5, atol=1e-6)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _data():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g)
    labels[0, :3] = -100  # some ignored positions
    return tokens, labels


def _build(extra: list[str], world: int):
    config = JobConfig.parse_args(["--training.mixed_precision_param", "float32", "--training.seed", "3", *extra])
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world)
    model = build_model(config, ARGS, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    single = ParallelDims(1, 1, 1, 1, 1, world_size=1, enable_loss_parallel=True)
    return model, build_model(config, ARGS, single, None, torch.device("cpu"))


def _reference(ref, tokens, labels):
    ref.zero_grad()
    loss = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def _compare(name, loss, model, ref_loss, ref_grads):
    torch.testing.assert_close(_full(loss.detach()), ref_loss, **TOL, msg=f"{name}: loss")
    for n, p in model.named_parameters():
        torch.testing.assert_close(_full(p.grad), ref_grads[n], **TOL, msg=f"{name}: grad of {n}")


def _tensor_parallel(world: int, tokens, labels, lp: bool) -> None:
    model, ref = _build(
        ["--training.tensor_parallel_degree", str(world), "--training.enable_loss_parallel", str(lp).lower()], world
    )
    assert isinstance(model.output.weight, DTensor)
    ctx = loss_parallel() if lp else torch.enable_grad()
    with ctx:
        hidden = model(tokens, return_hidden=True)  # (bs, seqlen / tp, dim) local: Shard(1) under SP
        loss = chunked_cross_entropy(hidden, model.output, labels, chunk_size=CHUNK)
        loss.backward()
    _compare(f"TP{world} loss_parallel={lp}", loss, model, *_reference(ref, tokens, labels))


def _fsdp(rank: int, world: int, tokens, labels, reshard: str) -> None:
    """Two steps: the second forward re-gathers what the first post-backward resharded. ``reshard``:
    training.fsdp_reshard_after_forward ('default' keeps the root's parameters from forward to backward,
    'always' frees them, and the loss gathers them again as Trainer's step does)."""
    flags = ["--training.data_parallel_shard_degree", str(world), "--training.fsdp_reshard_after_forward", reshard]
    model, ref = _build(flags, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    labels = labels.clone()
    labels[0, :3] = 0  # equal token counts per rank: the mean of rank means is then the global mean
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for step in range(2):
        opt.zero_grad()
        hidden = model(tokens[rows], return_hidden=True)
        # 'always': the root resharded after forward, output.weight is a Shard(0) DTensor over dp until
        # gathered again, as the trainer's step does; 'default': it was kept (torch's rule for the root)
        assert isinstance(model.output.weight, DTensor) == (reshard == "always"), reshard
        model.unshard()
        assert not isinstance(model.output.weight, DTensor)
        loss = chunked_cross_entropy(hidden, model.output, labels[rows], chunk_size=CHUNK)
        loss.backward()
        global_loss = loss.detach().clone()
        torch.distributed.all_reduce(global_loss)
        ref_loss, ref_grads = _reference(ref, tokens, labels)
        _compare(f"FSDP{world} {reshard} step {step}", global_loss / world, model, ref_loss, ref_grads)
        opt.step()
        ref_opt.step()


def _check(rank: int, world: int) -> str:
    tokens, labels = _data()
    _tensor_parallel(world, tokens, labels, lp=True)
    _tensor_parallel(world, tokens, labels, lp=False)
    _fsdp(rank, world, tokens, labels, "default")
    _fsdp(rank, world, tokens, labels, "always")
    return "ok"


def test_chunked_loss_under_tp_loss_parallel_and_fsdp():
    assert run_distributed(_check, 2) == ["ok", "ok"]
