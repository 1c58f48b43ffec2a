"""Distributed Muon (components/optim/muon.py) against one process: FSDP2 (2 and 4 ranks), FSDP2 x TP2, HSDP 2x2, EP2 (MoE).

Each rank builds the parallel model and, from the same seed, the single-process model; both train on the same
global batch (each data-parallel rank its slice). The reference optimizer is ``torch.optim.Muon`` on the hidden
matrices plus ``torch.optim.AdamW`` on the rest; an expert stack (3-D, which torch's Muon refuses) steps with our
Muon on one process, which tests/unit/test_muon.py holds equal to torch.optim.Muon per expert. After step 1 every
parameter must equal the reference within 1e-5 (absolute; fp32 master weights, the Newton-Schulz iteration in
bf16 as torch runs it; observed: see the test's print), and the 6 losses within rtol 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from tests.support.distributed import run_distributed
from torchtitan.build import build_model
from torchtitan.components.optim.muon import MuonAdam
from torchtitan.components.optim.muon_round_robin import RoundRobin
from torchtitan.components.optim.optimizer import build_optimizer
from torchtitan.config.manager import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.spec import get_model_spec

pytestmark = pytest.mark.distributed

GLOBAL_BATCH, SEQ, STEPS, LR = 4, 16, 6, 3e-3
ATOL_STEP1, LOSS_RTOL = 1e-5, 1e-5
LAYOUTS = {  # name: (world, flags)
    "fsdp2": (2, []),
    "fsdp4": (4, []),
    "fsdp2_tp2": (4, ["--training.tensor_parallel_degree", "2"]),
    "hsdp_2x2": (4, ["--training.data_parallel_replicate_degree", "2", "--training.data_parallel_shard_degree", "2"]),
    "ep2": (2, ["--model.name", "llama3_moe", "--experimental.expert_parallel_degree", "2"]),
}

# Muon matrices per orthogonalisation path (components/optim/muon_round_robin.py): FSDP alone shards Shard(0) on one
# axis (round-robin); FSDP x TP's strided shards gather. EP2: the dense matrices on FSDP's axis and the 9 expert
# stacks on EP's (their mesh's other axis, the experts' FSDP axis, has size 1): round-robin.
EXPECTED_PATHS = {
    "fsdp2": {"round_robin": 28, "gather": 0},
    "fsdp4": {"round_robin": 28, "gather": 0},
    "fsdp2_tp2": {"round_robin": 0, "gather": 28},
    "hsdp_2x2": {"round_robin": 0, "gather": 28},  # (Replicate, Shard(0)) on two axes of size 2
    "ep2": {"round_robin": 37, "gather": 0},
}


def _config(flags: list[str], world: int) -> JobConfig:
    return JobConfig.parse_args(
        [
            "--model.flavor",
            "debugmodel_tiny",
            "--training.mixed_precision_param",
            "float32",
            "--training.seed",
            "5",
            "--training.enable_loss_parallel",
            "false",
            "--optimizer.name",
            "Muon",
            "--optimizer.lr",
            str(LR),
            *flags,
        ],
        world_size=world,
    )


def _reference_optimizers(model, opt_config) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    matrices = [p for n, p in named if n.startswith("layers.") and p.ndim == 2 and "router" not in n]
    stacks = [p for n, p in named if p.ndim == 3]
    rest = [p for n, p in named if not any(p is q for q in matrices + stacks)]
    opts = [
        torch.optim.Muon(matrices, lr=LR, weight_decay=0.1, momentum=0.95, nesterov=True),
        torch.optim.AdamW(rest, lr=LR, betas=(opt_config.beta1, opt_config.beta2), weight_decay=0.1),
    ]
    if stacks:  # experts: ours on one process (equal to torch.optim.Muon per expert, tests/unit/test_muon.py)
        opts.append(build_optimizer([_Only(stacks)], opt_config))
    return opts


class _Only(torch.nn.Module):
    def __init__(self, params):
        super().__init__()
        self.stacks = torch.nn.ParameterList(params)

    def named_parameters(self, *args, **kwargs):  # the stacks under their canonical-looking names
        return ((f"layers.{i}.feed_forward.experts.w1", p) for i, p in enumerate(self.stacks))


def _step(model, opts, data) -> torch.Tensor:
    loss = F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
    loss.backward()
    for o in opts:
        o.step()
        o.zero_grad()
    return loss.detach()


def _one_step_on_the_same_gradient(model, opt, ref, ref_opts, layout: str) -> float:
    """One step from one full gradient per parameter (each rank its shard of it): the optimizers alone, without
    the layouts' gradient summation order, which the bf16 Newton-Schulz would amplify (see the losses below)."""
    g = torch.Generator().manual_seed(7)
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        full = torch.randn(p.shape, generator=g) * 1e-2
        ref_params[n].grad = full.clone()
        p.grad = distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full
    opt.step()
    for o in ref_opts:
        o.step()
    worst = 0.0
    for n, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        diff = (full - ref_params[n]).abs().max().item()
        assert diff <= ATOL_STEP1, f"{layout}: {n} differs from one process by {diff} after one step"
        worst = max(worst, diff)
    opt.zero_grad()
    for o in ref_opts:
        o.zero_grad()
    return worst


def _check(rank: int, world: int, layout: str) -> dict:
    torch.set_num_threads(1)
    config = _config(LAYOUTS[layout][1], world)
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world)
    args = dataclasses.replace(get_model_spec(config.model.name).flavors["debugmodel_tiny"], vocab_size=256)
    model = build_model(config, args, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    ref_config = _config([f for f in LAYOUTS[layout][1] if f in ("--model.name", "llama3_moe")], 1)
    ref_dims = ParallelDims.from_sections(
        training=ref_config.training, experimental=ref_config.experimental, world_size=1
    )
    ref = build_model(ref_config, args, ref_dims, None, torch.device("cpu"))
    opt = build_optimizer([model], config.optimizer)
    assert isinstance(opt, MuonAdam)
    ref_opts = _reference_optimizers(ref, config.optimizer)
    step1 = _one_step_on_the_same_gradient(model, opt, ref, ref_opts, layout)
    dp, dp_rank = world // dims.tp, rank // dims.tp
    per = GLOBAL_BATCH // dp
    g = torch.Generator().manual_seed(0)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        data = torch.randint(0, args.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g)
        loss = _step(model, [opt], data[dp_rank * per : (dp_rank + 1) * per])
        torch.distributed.all_reduce(loss)
        losses.append(loss.item() / world)  # tp ranks hold the same loss: the mean over all ranks is dp's mean
        ref_losses.append(_step(ref, ref_opts, data).item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    # The momentum is sharded like its parameter, and DCP's optimizer state dict round trip keeps it.
    p = next(p for n, p in model.named_parameters() if n.endswith("attention.wq.weight"))
    buf = opt.state[p]["momentum_buffer"]
    assert (
        isinstance(buf, DTensor) and buf.placements == p.placements and buf._local_tensor.shape == p._local_tensor.shape
    )
    osd = get_optimizer_state_dict(model, opt)
    set_optimizer_state_dict(model, opt, osd)
    muon = [p for g in opt.param_groups if g["optimizer"] == "Muon" for p in g["params"]]
    paths = {
        "round_robin": sum(RoundRobin.takes(p) for p in muon),
        "gather": sum(not RoundRobin.takes(p) for p in muon),
    }
    return {"losses": losses, "step1_max_diff": step1, "paths": paths}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_distributed_muon_equals_one_process(layout):
    world = LAYOUTS[layout][0]
    results = run_distributed(_check, world, layout)
    paths = results[0]["paths"]
    print(f"{layout}: step-1 max |param - one process| {max(r['step1_max_diff'] for r in results):.2e}; {paths}")
    assert paths == EXPECTED_PATHS[layout]
