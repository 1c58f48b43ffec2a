"""Ring attention (torchtitan.distributed.context_parallel.context_parallel) against single-process CausalAttention.

One spawn per world size computes everything (spawns dominate the cost); the tests below read its
results: attention output and q/k/v gradients for every variant (GQA and MHA, both rotate methods,
load balancing on and off, bf16), the overlap order of the ring, and on a tiny llama the loss,
the gradients and the activation memory saved for backward against the unsharded model.
"""

from __future__ import annotations

import copy
import functools
import itertools
from contextlib import contextmanager

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import torchtitan.distributed.context_parallel.context_parallel as cp_module
from tests.support.distributed import run_distributed
from torchtitan.distributed.context_parallel.context_parallel import (
    RingAttention,
    apply_cp,
    compute_cp_positions,
    shard_sequence,
)
from torchtitan.distributed.context_parallel.torch_context_parallel import (
    TorchRingAttention,
    enable_torch_cp_dispatcher,
)
from torchtitan.models.llama.model import CausalAttention, ModelArgs, Transformer

pytestmark = pytest.mark.distributed

BS, N_HEADS, SEQ, HEAD_DIM = 2, 4, 32, 8
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: only the order of the softmax reductions differs
BF16_TOL = dict(rtol=3e-2, atol=3e-2)  # bf16 inputs and outputs, fp32 accumulation inside
MODEL_SEQ = 512
WORLD_SIZES = (2, 4)
VARIANTS = [
    dict(n_kv_heads=n_kv, rotate_method=rotate, load_balance=lb, dtype="float32")
    for n_kv, rotate, lb in itertools.product((2, 4), ("allgather", "alltoall"), (True, False))
]
VARIANTS += [
    dict(n_kv_heads=2, rotate_method=rotate, load_balance=True, dtype="bfloat16")
    for rotate in ("allgather", "alltoall")
]
# torch's own ring attention (context_parallel_impl = "torch"; our CPU kernel handlers)
VARIANTS += [
    dict(n_kv_heads=2, rotate_method=rotate, load_balance=lb, dtype="float32", impl="torch")
    for rotate, lb in itertools.product(("allgather", "alltoall"), (True, False))
]


def _name(variant: dict) -> str:
    balance = "lb" if variant["load_balance"] else "nolb"
    impl = "torch-" if variant.get("impl") == "torch" else ""
    return impl + "{rotate_method}-kv{n_kv_heads}-{dtype}-{balance}".format(**variant, balance=balance)


def _attention_case(
    rank: int,
    world: int,
    mesh,
    n_kv_heads: int,
    rotate_method: str,
    load_balance: bool,
    dtype: str,
    impl: str = "portable",
) -> dict:
    """Ring attention on this rank's shard vs CausalAttention on the whole sequence (same seed everywhere)."""
    torch.manual_seed(0)
    q, dout = torch.randn(BS, N_HEADS, SEQ, HEAD_DIM), torch.randn(BS, N_HEADS, SEQ, HEAD_DIM)
    k, v = torch.randn(BS, n_kv_heads, SEQ, HEAD_DIM), torch.randn(BS, n_kv_heads, SEQ, HEAD_DIM)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    CausalAttention()(*full).backward(dout)
    positions = compute_cp_positions(SEQ, world, rank, load_balance)
    local = [t.to(getattr(torch, dtype)).requires_grad_() for t in shard_sequence([q, k, v], 2, positions)]
    if impl == "torch":
        ring = TorchRingAttention(mesh, rotate_method=rotate_method, load_balance=load_balance)
    else:
        ring = RingAttention(mesh.get_group(), rotate_method=rotate_method, load_balance=load_balance)
    out = ring(*local)
    out.backward(shard_sequence([dout], 2, positions)[0].to(out.dtype))
    expected_out = shard_sequence([CausalAttention()(q, k, v)], 2, positions)[0]
    return {
        "out": out.detach(),
        "grads": [t.grad for t in local],
        "out_dtype": str(out.dtype),
        "expected_out": expected_out,
        "expected_grads": shard_sequence([t.grad for t in full], 2, positions),
    }


@contextmanager
def _record_ring_events():
    """Log the order of ring hops and block computations (the overlap schedule)."""
    events: list[str] = []
    originals = {
        name: getattr(cp_module, name) for name in ("_ring_shift", "_accumulate_block", "_accumulate_block_grad")
    }

    def logged(name, fn):
        def wrapper(*args, **kwargs):
            events.append(name if name != "_ring_shift" else f"shift:{args[2]}")  # tag: 0 K/V, 1 dK/dV
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(cp_module, name, logged(name, fn))
    try:
        yield events
    finally:
        for name, fn in originals.items():
            setattr(cp_module, name, fn)


def _ring_events(group) -> dict:
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    ring = RingAttention(group, rotate_method="alltoall", load_balance=True)
    with _record_ring_events() as forward:
        out = ring(q, q, q)
    with _record_ring_events() as backward:
        out.sum().backward()
    return {"forward": forward, "backward": backward}


def _saved_bytes(model: torch.nn.Module, fn):
    """fn()'s result and the bytes of non-parameter tensors autograd saved, each storage once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(seen.values())


def _loss(model, inputs, labels, positions=None) -> torch.Tensor:
    logits = model(inputs, positions)  # (bs, seqlen, vocab)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _model_case(rank: int, world: int, mesh) -> dict:
    """Tiny llama: the unsharded model (cp = 1) vs the same weights with ring attention on cp ranks."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=MODEL_SEQ))
    model.init_weights()
    tokens = torch.randint(0, 256, (BS, MODEL_SEQ + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    cp_model = copy.deepcopy(model)
    ref_loss, ref_bytes = _saved_bytes(model, lambda: _loss(model, inputs, labels))
    ref_loss.backward()
    apply_cp(cp_model, mesh, rotate_method="alltoall")
    positions = compute_cp_positions(MODEL_SEQ, world, rank, load_balance=True)
    local_inputs, local_labels = shard_sequence([inputs, labels], 1, positions)
    loss, cp_bytes = _saved_bytes(cp_model, lambda: _loss(cp_model, local_inputs, local_labels, positions))
    loss.backward()  # of this rank's mean; the global loss is the mean over ranks (equal token counts)
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    grads = {}
    for name, p in cp_model.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = p.grad / world
    return {
        "loss": global_loss / world,
        "ref_loss": ref_loss.detach(),
        "cp_bytes": cp_bytes,
        "ref_bytes": ref_bytes,
        "grads": grads,
        "ref_grads": {name: p.grad for name, p in model.named_parameters()},
    }


def _odd_seqlen_error(group) -> str:
    try:
        RingAttention(group, rotate_method="alltoall", load_balance=True)(*[torch.randn(1, 2, 3, 8)] * 3)
    except ValueError as e:
        return str(e)
    return "no error"


def _run_all(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    enable_torch_cp_dispatcher()
    results = {_name(variant): _attention_case(rank, world, mesh, **variant) for variant in VARIANTS}
    results["events"] = _ring_events(group)
    results["model"] = _model_case(rank, world, mesh)
    results["odd_seqlen_error"] = _odd_seqlen_error(group)
    return _map_tensors(results, lambda t: t.float().numpy())


def _map_tensors(obj, fn):
    """Apply fn to every tensor/array in nested dicts, lists and tuples."""
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return fn(obj) if isinstance(obj, (torch.Tensor, np.ndarray)) else obj


@functools.cache
def _results(world: int) -> list[dict]:
    # Arrays, not tensors, cross the process boundary: torch would share them through file
    # descriptors that vanish when the rank exits.
    return _map_tensors(run_distributed(_run_all, world), torch.from_numpy)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_ring_attention_matches_causal_attention(world: int, variant: dict) -> None:
    tol = TOL if variant["dtype"] == "float32" else BF16_TOL
    for rank, result in enumerate(_results(world)):
        case = result[_name(variant)]
        assert case["out_dtype"] == f"torch.{variant['dtype']}"
        torch.testing.assert_close(case["out"], case["expected_out"], **tol, msg=lambda m, r=rank: f"rank {r} out: {m}")
        for name, got, want in zip("qkv", case["grads"], case["expected_grads"]):
            torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name, r=rank: f"rank {r} d{n}: {m}")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ring_posts_next_hop_before_computing_current_block(world: int) -> None:
    events = _results(world)[0]["events"]
    # forward: cp-1 K/V hops, each posted before the block it overlaps; the last block has none.
    assert events["forward"] == ["shift:0", "_accumulate_block"] * (world - 1) + ["_accumulate_block"]
    # backward: K/V hop, block grads, then the dK/dV accumulator moves on; cp accumulator hops in
    # all, so each ends on its owner.
    step = ["shift:0", "_accumulate_block_grad", "shift:1"]
    assert events["backward"] == step * (world - 1) + ["_accumulate_block_grad", "shift:1"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_cp_llama_loss_and_grads_match_single_process(world: int) -> None:
    for result in _results(world):
        model = result["model"]
        torch.testing.assert_close(model["loss"], model["ref_loss"], rtol=1e-5, atol=0)
        for name, want in model["ref_grads"].items():
            # fp32; the CP grads are summed over ranks in a different order, hence atol 1e-6
            torch.testing.assert_close(
                model["grads"][name], want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"grad {n}: {m}"
            )


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_activation_memory_per_rank_shrinks_with_cp(world: int) -> None:
    for rank, result in enumerate(_results(world)):
        ref_bytes, cp_bytes = result["model"]["ref_bytes"], result["model"]["cp_bytes"]
        print(
            f"seq {MODEL_SEQ}: cp=1 saves {ref_bytes} B; cp={world} rank {rank} saves {cp_bytes} B "
            f"({cp_bytes * world / ref_bytes:.3f} x cp1/cp)"
        )
        assert cp_bytes <= 1.15 * ref_bytes / world


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_seqlen_that_does_not_fit_the_layout_is_rejected(world: int) -> None:
    message = _results(world)[0]["odd_seqlen_error"]
    assert "local seqlen of 3" in message and f"context_parallel_degree = {world}" in message
