"""Ring attention for the kernels of the newer families, 2 ranks, against the single-process kernel.

* v heads narrower than q/k heads (DeepSeek-V3's MLA): RingAttention vs CausalAttention;
* a sliding window and attention sinks (gpt-oss): RingSinkAttention vs gpt-oss's SinkAttention, with
  windows smaller than a load-balanced chunk, between a chunk and a rank's shard, larger than a
  shard, and none; the sinks' gradient summed over the CP ranks (what FSDP's reduce over
  dp_shard_cp does with every parameter's) equals the single-process one;

each with and without documents, both rotate methods, load balancing on and off: output and every
gradient gathered back into the whole sequence, max |diff| <= 1e-5 (fp32). Then the tiny gpt_oss
and deepseek_v3 models under ``apply_cp``: loss and parameter gradients (averaged over the CP ranks
as FSDP averages them) equal one process. One spawn runs every case.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from tests.support.distributed import run_distributed
from torchtitan.distributed.context_parallel.context_parallel import (
    RingAttention,
    RingSinkAttention,
    apply_cp,
    compute_cp_positions,
    shard_sequence,
)
from torchtitan.models.deepseek_v3 import DeepSeekV3Transformer, deepseek_v3_configs
from torchtitan.models.gpt_oss import GptOssTransformer, gpt_oss_configs
from torchtitan.models.gpt_oss.model import SinkAttention
from torchtitan.models.llama.model import CausalAttention

pytestmark = [pytest.mark.distributed, pytest.mark.pool(2)]

WORLD = 2
BS, N_HEADS, SEQ = 2, 4, 32  # a load-balanced chunk is SEQ / 4 = 8 tokens, a rank's shard 16
QK_DIM, V_DIM, SINK_DIM = 24, 16, 8
ATOL = 1e-5  # fp32: max abs difference; only the order of the softmax reductions differs
LAYOUTS = list(itertools.product(("allgather", "alltoall"), (True, False)))  # (rotate_method, load_balance)
MLA_CASES = [(rotate, lb, n_kv, docs) for (rotate, lb), n_kv, docs in itertools.product(LAYOUTS, (4, 2), (False, True))]
WINDOWS = (3, 12, 20, None)  # < a chunk; between a chunk and a shard; > a shard; the whole causal context
SINK_CASES = [(rotate, lb, w, docs) for (rotate, lb), w, docs in itertools.product(LAYOUTS, WINDOWS, (False, True))]
MODEL_SEQ = 64


def _documents() -> torch.Tensor:
    """(BS, SEQ) document ids: short random documents, some crossing chunk edges."""
    starts = torch.rand(BS, SEQ, generator=torch.Generator().manual_seed(1)) < 0.15
    starts[:, 0] = True
    return starts.long().cumsum(1) - 1


def _gather(local: torch.Tensor, load_balance: bool) -> torch.Tensor:
    """(bs, h, s_local, d) shards of every rank -> (bs, h, SEQ, d) in sequence order."""
    parts = [torch.empty_like(local) for _ in range(WORLD)]
    dist.all_gather(parts, local.contiguous())
    full = torch.empty(*local.shape[:2], SEQ, local.shape[3], dtype=local.dtype)
    for j, part in enumerate(parts):
        full[:, :, compute_cp_positions(SEQ, WORLD, j, load_balance)] = part
    return full


def _compare(rank, ring, reference, inputs, docs, load_balance, sharded_args=()) -> dict[str, float]:
    """Run ``ring`` on this rank's shard and ``reference`` on the whole sequence; max |diff| of out and grads.

    inputs: [q, k, v] (sequence dim 2) then unsharded extras (the sinks), whose gradient is summed over ranks.
    """
    torch.manual_seed(1)
    dout = torch.randn(BS, N_HEADS, SEQ, inputs[2].shape[-1])
    full = [t.clone().requires_grad_() for t in inputs]
    want_out = reference(*full, doc_ids=docs)
    want_out.backward(dout)
    positions = compute_cp_positions(SEQ, WORLD, rank, load_balance)
    local = [t.requires_grad_() for t in shard_sequence(inputs[:3], 2, positions)]
    extras = [t.clone().requires_grad_() for t in inputs[3:]]
    local_docs = None if docs is None else shard_sequence([docs], 1, positions)[0]
    out = ring(*local, *extras, doc_ids=local_docs)
    out.backward(shard_sequence([dout], 2, positions)[0])
    got = [_gather(t, load_balance) for t in (out.detach(), *(t.grad for t in local))]
    for t in extras:
        got.append(t.grad.clone())
        dist.all_reduce(got[-1])  # replicated over CP: each rank holds its queries' share
    want = [want_out.detach(), *(t.grad for t in full)]
    names = ("out", "dq", "dk", "dv", "dsinks")
    return {name: float((g - w).abs().max()) for name, g, w in zip(names, got, want)}


def _mla_case(rank, group, rotate_method, load_balance, n_kv_heads, with_docs) -> dict[str, float]:
    torch.manual_seed(0)
    q, k = torch.randn(BS, N_HEADS, SEQ, QK_DIM), torch.randn(BS, n_kv_heads, SEQ, QK_DIM)
    v = torch.randn(BS, n_kv_heads, SEQ, V_DIM)
    ring = RingAttention(group, rotate_method=rotate_method, load_balance=load_balance)
    docs = _documents() if with_docs else None
    return _compare(rank, ring, CausalAttention(), [q, k, v], docs, load_balance)


def _sink_case(rank, group, rotate_method, load_balance, window, with_docs) -> dict[str, float]:
    torch.manual_seed(0)
    q, k = torch.randn(BS, N_HEADS, SEQ, SINK_DIM), torch.randn(BS, 2, SEQ, SINK_DIM)
    v, sinks = torch.randn(BS, 2, SEQ, SINK_DIM), torch.randn(N_HEADS)
    ring = RingSinkAttention(group, window=window, rotate_method=rotate_method, load_balance=load_balance)
    docs = _documents() if with_docs else None
    return _compare(rank, ring, SinkAttention(window), [q, k, v, sinks], docs, load_balance)


def _model_case(rank, mesh, build) -> dict:
    """A tiny model on the whole sequence vs the same weights under apply_cp (alltoall, load-balanced)."""
    torch.manual_seed(0)
    model = build()
    model.init_weights()
    tokens = torch.randint(0, 256, (BS, MODEL_SEQ + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    cp_model = copy.deepcopy(model)
    ref_loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    ref_loss.backward()
    apply_cp(cp_model, mesh, rotate_method="alltoall")
    kernels = sorted({type(block.attention.sdpa).__name__ for block in cp_model.layers.values()})
    windows = [getattr(block.attention.sdpa, "window", None) for block in cp_model.layers.values()]
    positions = compute_cp_positions(MODEL_SEQ, WORLD, rank, load_balance=True)
    local_inputs, local_labels = shard_sequence([inputs, labels], 1, positions)
    loss = F.cross_entropy(cp_model(local_inputs, positions).flatten(0, 1), local_labels.flatten())
    loss.backward()  # of this rank's mean; the global loss is the mean over ranks (equal token counts)
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    worst = 0.0
    for (name, p), ref in zip(cp_model.named_parameters(), model.parameters()):
        dist.all_reduce(p.grad)  # FSDP over dp_shard_cp averages every gradient over the CP ranks
        torch.testing.assert_close(p.grad / WORLD, ref.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        worst = max(worst, float((p.grad / WORLD - ref.grad).abs().max()))
    return {
        "loss": float(loss / WORLD),
        "ref_loss": float(ref_loss),
        "kernels": kernels,
        "windows": windows,
        "grad": worst,
    }


def _gpt_oss() -> GptOssTransformer:
    return GptOssTransformer(
        dataclasses.replace(gpt_oss_configs["debugmodel_tiny"], vocab_size=256, max_seq_len=MODEL_SEQ)
    )


def _deepseek_v3() -> DeepSeekV3Transformer:
    return DeepSeekV3Transformer(
        dataclasses.replace(deepseek_v3_configs["debugmodel_tiny"], vocab_size=256, max_seq_len=MODEL_SEQ)
    )


def _run_all(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    return {
        "mla": {case: _mla_case(rank, group, *case) for case in MLA_CASES},
        "sinks": {case: _sink_case(rank, group, *case) for case in SINK_CASES},
        "gpt_oss": _model_case(rank, mesh, _gpt_oss),
        "deepseek_v3": _model_case(rank, mesh, _deepseek_v3),
    }


@functools.cache
def _results() -> list[dict]:
    return run_distributed(_run_all, WORLD)


def _case_id(case: tuple) -> str:
    rotate, lb, third, docs = case
    return f"{rotate}-{'lb' if lb else 'nolb'}-{third}-{'docs' if docs else 'causal'}"


@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: _case_id((*c[:2], f"kv{c[2]}", c[3])))
def test_ring_attention_with_narrower_v_heads_matches_causal_attention(case: tuple) -> None:
    for rank, result in enumerate(_results()):
        diffs = result["mla"][case]
        print(f"mla {case} rank {rank}: max |diff| {diffs}")
        assert all(diff <= ATOL for diff in diffs.values()), f"rank {rank}: {diffs} (atol {ATOL})"


@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: _case_id((*c[:2], f"window{c[2]}", c[3])))
def test_ring_sink_attention_matches_sink_attention(case: tuple) -> None:
    for rank, result in enumerate(_results()):
        diffs = result["sinks"][case]
        print(f"sinks {case} rank {rank}: max |diff| {diffs}")
        assert set(diffs) == {"out", "dq", "dk", "dv", "dsinks"}
        assert all(diff <= ATOL for diff in diffs.values()), f"rank {rank}: {diffs} (atol {ATOL})"


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_cp_model_loss_and_grads_match_single_process(family: str) -> None:
    kernels = {"gpt_oss": ["RingSinkAttention"], "deepseek_v3": ["RingAttention"]}[family]
    windows = {"gpt_oss": [16, None, 16, None], "deepseek_v3": [None] * 4}[family]
    for result in _results():
        model = result[family]
        print(f"{family}: cp loss {model['loss']:.8f} vs {model['ref_loss']:.8f}; max |dgrad| {model['grad']:.2e}")
        assert model["kernels"] == kernels and model["windows"] == windows
        assert abs(model["loss"] - model["ref_loss"]) <= 1e-5 * abs(model["ref_loss"])
