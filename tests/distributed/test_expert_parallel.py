"""Expert parallel against the single-process MoE layer (and a 2-layer MoE model) on the same global batch.

Each EP rank holds a different slice of the tokens and takes the mean loss over its slice (plain
data parallel). The reference runs the whole batch in one process with the global mean loss. After
the documented reduction (replicated grads: AVG over ranks; expert grads: as they come out of EP),
outputs and every gradient must match. Tolerance: fp32, rtol 1e-5 / atol 1e-6 (grads are O(1e-2);
observed max difference ~5e-8); EP only changes the matmul row blocking and the order of sums.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from tests.support.distributed import run_distributed
from torchtitan.distributed.expert_parallel.experts import ExpertParallel, apply_ep
from torchtitan.distributed.init import init_model_weights
from torchtitan.models.moe import MoE, MoEArgs, MoETransformer

pytestmark = pytest.mark.distributed

ARGS = MoEArgs(
    dim=32,
    n_heads=4,
    num_experts=8,
    top_k=2,
    moe_hidden_dim=16,
    num_shared_experts=1,
    score_func="softmax",
    load_balance="bias",
)
BATCH, SEQ = 8, 5  # global batch: BATCH sequences, split evenly over the EP ranks
TOL = dict(rtol=1e-5, atol=1e-6)

# expert_bias per case: None keeps the learned routing; the forced one sends every token to
# experts 0 and 1 (owned by rank 0 at EP 2 and EP 4), so the other ranks and experts get nothing.
CASES = {"random": None, "all_to_rank0": [0.0, 0.0] + [-10.0] * 6}


def _check(results: list, case: str, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    ok = torch.allclose(got, want, **TOL)
    results.append((case, name, ok, (got - want).abs().max().item() if got.numel() else 0.0))


def _run_case(rank, world_size, mesh, case, use_gmm, results):
    torch.manual_seed(0)
    ref = MoE(dataclasses.replace(ARGS, use_grouped_mm=use_gmm))
    ref.init_weights(init_std=0.02)
    if CASES[case] is not None:
        ref.expert_bias.copy_(torch.tensor(CASES[case]))
    ep = copy.deepcopy(ref)
    parallelize_module(ep.experts, mesh, ExpertParallel())
    assert isinstance(ep.experts.w1, DTensor) and ep.experts.w1.placements == (Shard(0),)

    x, target = torch.randn(BATCH, SEQ, ARGS.dim), torch.randn(BATCH, SEQ, ARGS.dim)
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    x_ref, x_local = x.clone().requires_grad_(), x[rows].clone().requires_grad_()
    out_ref = ref(x_ref)
    ((out_ref - target) ** 2).mean().backward()
    with CommDebugMode() as fwd:
        out = ep(x_local)
    with CommDebugMode() as bwd:
        ((out - target[rows]) ** 2).mean().backward()
    # forward: the counts and the tokens there and back; backward: the tokens back and there
    a2a = [c.get_comm_counts().get(torch.ops.c10d_functional.all_to_all_single, 0) for c in (fwd, bwd)]
    tag = f"{case}/{'gmm' if use_gmm else 'loop'}"
    results.append((tag, f"all-to-alls forward, backward = {a2a}", a2a == [3, 2], 0.0))
    _check(results, tag, "output", out, out_ref[rows])
    # local mean loss = world_size x its share of the global mean, so the input grad is too
    _check(results, tag, "input grad", x_local.grad / world_size, x_ref.grad[rows])
    counts = ep.tokens_per_expert.clone()
    dist.all_reduce(counts)  # what the trainer's update_expert_bias reduce_fn does
    _check(results, tag, "global tokens_per_expert", counts, ref.tokens_per_expert)
    ref_params = dict(ref.named_parameters())
    for name, grad in _reduced_grads(ep).items():
        _check(results, tag, f"grad {name}", grad, ref_params[name].grad)
    if CASES[case] is not None and rank > 0:  # this rank's experts received no tokens
        local = [p.grad.to_local() for p in ep.experts.parameters()]
        results.append((tag, "idle rank grads are zero tensors", all(g.abs().sum() == 0 for g in local), 0.0))


def _reduced_grads(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        if isinstance(p.grad, DTensor):
            grads[name] = p.grad.full_tensor()
        else:
            grads[name] = p.grad.clone()
            dist.all_reduce(grads[name], op=dist.ReduceOp.AVG)
    return grads


def _run_model(rank, world_size, mesh, results):
    """apply_ep on a whole meta model, then the layout-invariant init: same weights, logits, grads."""
    args = dataclasses.replace(ARGS, n_layers=2, vocab_size=64, max_seq_len=SEQ)
    models = []
    for ep in (False, True):
        with torch.device("meta"):
            model = MoETransformer(args)
        if ep:
            apply_ep(model, mesh)
        model.to_empty(device="cpu")
        init_model_weights(model, seed=5, buffer_device=torch.device("cpu"))
        models.append(model)
    ref, ep = models
    tokens = torch.randint(0, 64, (BATCH, SEQ))
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    for model, batch in ((ref, tokens), (ep, tokens[rows])):
        logits = model(batch)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten()).backward()
    ref_params, ref_logits = dict(ref.named_parameters()), ref(tokens[rows])
    for name, p in ep.named_parameters():
        _check(results, "model", f"init {name}", p.full_tensor() if isinstance(p, DTensor) else p, ref_params[name])
    _check(results, "model", "logits", ep(tokens[rows]), ref_logits)
    for name, grad in _reduced_grads(ep).items():
        _check(results, "model", f"grad {name}", grad, ref_params[name].grad)


def _ep_parity(rank: int, world_size: int) -> list:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    results: list = []
    for case in CASES:
        for use_gmm in (True, False):
            _run_case(rank, world_size, mesh, case, use_gmm, results)
    _run_model(rank, world_size, mesh, results)
    try:  # 3 experts cannot be split evenly over 2 or 4 ranks
        parallelize_module(MoE(dataclasses.replace(ARGS, num_experts=3)).experts, mesh, ExpertParallel())
        message = ""
    except ValueError as e:
        message = str(e)
    named = "num_experts = 3" in message and "divides" in message
    results.append(("num_experts=3", "ValueError names the value and the fix", named, 0.0))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_ep_matches_single_process(world_size):
    for rank, results in enumerate(run_distributed(_ep_parity, world_size)):
        bad = [(case, name, diff) for case, name, ok, diff in results if not ok]
        assert not bad, f"rank {rank}: {bad}"
        # 4 layer runs x (a2a count, output, input grad, counts, 7 grads), the idle-rank check on ranks > 0 in 2 runs,
        # the model (init + grad of each of its 25 params, logits), the error
        assert len(results) == 4 * 11 + (2 if rank > 0 else 0) + 2 * 25 + 1 + 1
