"""Adam / AdamW stepped on local shards (components/optim/local_shards.py) against torch's own step over the same
DTensors: bit for bit, with no DTensor op dispatched by the step."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.support.distributed import run_distributed
from torchtitan.components.optim import local_shards

pytestmark = [pytest.mark.distributed, pytest.mark.pool(2)]

STEPS = 3


def _params(mesh) -> list[torch.Tensor]:
    """FSDP's Shard(0) (one uneven), TP's Shard(1), a replicated norm weight (torch's foreach step refuses a plain
    tensor in the same list)."""
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(8, 6, generator=g), torch.randn(5, 3, generator=g), torch.randn(4, 6, generator=g)]
    full.append(torch.randn(6, generator=g))
    placements = [(Shard(0),), (Shard(0),), (Shard(1),), (Replicate(),)]
    out = [distribute_tensor(t, mesh, p) for t, p in zip(full, placements, strict=True)]
    return [torch.nn.Parameter(t) for t in out]


def _grads(mesh, params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """Gradients with their parameters' placements, and one Partial (a norm weight's under plain TP)."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for i, p in enumerate(params):
        full = torch.randn(p.shape, generator=g)
        if i == 3:  # each rank holds half of the sum
            out.append(DTensor.from_local(full / 2, mesh, (Partial(),), run_check=False))
        else:
            out.append(distribute_tensor(full, mesh, p.placements))
    return out


def _compare(rank: int, world: int, cls_name: str, impl: str) -> int:
    mesh = init_device_mesh("cpu", (world,))
    torch_cls, ours_cls = {
        "Adam": (torch.optim.Adam, local_shards.Adam),
        "AdamW": (torch.optim.AdamW, local_shards.AdamW),
    }[cls_name]
    theirs_p, ours_p = _params(mesh), _params(mesh)
    settings = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, impl: True}
    theirs, ours = torch_cls(theirs_p, **settings), ours_cls(ours_p, **settings)
    dispatched = {}
    for step in range(STEPS):
        for params in (theirs_p, ours_p):
            for p, grad in zip(params, _grads(mesh, params, step), strict=True):
                p.grad = grad
        for name, opt in (("theirs", theirs), ("ours", ours)):
            with _DTensorOps() as seen:
                opt.step()
            if step:  # the first step creates the moments (zeros_like of each DTensor, in both)
                dispatched[name] = dispatched.get(name, 0) + seen.count
    for a, b in zip(theirs_p, ours_p, strict=True):
        assert isinstance(b, DTensor) and torch.equal(a._local_tensor, b._local_tensor)  # bit for bit
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = theirs.state[a][key], ours.state[b][key]
            assert isinstance(y, DTensor) and torch.equal(x._local_tensor, y._local_tensor), key
            assert y.placements == a.placements and y.device_mesh == a.device_mesh
        assert torch.equal(theirs.state[a]["step"], ours.state[b]["step"])
    return dispatched


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("cls_name", ["Adam", "AdamW"])
def test_local_shard_step_equals_torch_step_on_dtensors(cls_name, impl):
    dispatched = run_distributed(_compare, 2, cls_name, impl)
    # torch's step dispatches each op of the update with DTensors, ours none (the Partial gradient's redistribution
    # is a collective)
    assert all(d["ours"] == 0 < d["theirs"] for d in dispatched), dispatched


class _DTensorOps(TorchDispatchMode):
    """Counts the ops dispatched with a DTensor among their arguments (what DTensor's sharding propagation sees)."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs or {})))
        return func(*args, **(kwargs or {}))
