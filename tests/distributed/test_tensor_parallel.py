"""Tensor parallel (+ sequence and loss parallel) against the single-process reference.

Compares the loss and every parameter's gradient (gathered) over a few AdamW steps, for TP 2 and 4,
loss parallel on and off, FSDP x TP, and our async (ring) TP; counts each block's collectives.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel

from tests.support.distributed import run_distributed
from torchtitan.build import build_model
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.config.manager import JobConfig
from torchtitan.distributed.grad_norm import clip_grad_norm_, reduce_partial_grads_
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import ModelArgs

pytestmark = pytest.mark.distributed

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=128, multiple_of=32, max_seq_len=16)
GLOBAL_BATCH, SEQ, STEPS = 4, 16, 3
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32; TP only changes the order of the reductions


def _config(tp: int, dp_shard: int, loss_parallel_on: bool, async_tp: bool) -> JobConfig:
    return JobConfig.parse_args(
        [
            "--training.tensor_parallel_degree",
            str(tp),
            "--training.data_parallel_shard_degree",
            str(dp_shard),
            f"--training.enable_loss_parallel={str(loss_parallel_on).lower()}",
            f"--experimental.enable_async_tensor_parallel={str(async_tp).lower()}",
            "--training.mixed_precision_param",
            "float32",
            "--training.seed",
            "3",
            "--activation_checkpoint.mode",
            "none",
        ]
    )


def _batches():
    g = torch.Generator().manual_seed(1)
    shape = (GLOBAL_BATCH, SEQ)
    return [
        (torch.randint(0, 128, shape, generator=g), torch.randint(0, 128, shape, generator=g)) for _ in range(STEPS)
    ]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model, dims: ParallelDims, dp_rank: int):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ctx = loss_parallel if dims.loss_parallel_enabled else torch.enable_grad
    per_rank = GLOBAL_BATCH // dims.dp_degree
    losses, norms, clip_comms, grads = [], [], [], {}
    for x, y in _batches():
        x, y = x[dp_rank * per_rank : (dp_rank + 1) * per_rank], y[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        with ctx():
            loss = cross_entropy_loss(model(x), y)
            loss.backward()
        losses.append(_full(loss.detach()))
        reduce_partial_grads_(model.parameters())
        with CommDebugMode() as comm:
            norms.append(clip_grad_norm_(model.parameters(), max_norm=0.5).item())
        clip_comms.append(comm.get_total_counts())
        grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, norms, clip_comms, grads


def _check(rank: int, world: int, tp: int, loss_parallel_on: bool, async_tp: bool):
    import torch.distributed as dist

    config = _config(tp, world // tp, loss_parallel_on, async_tp)
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world)
    mesh = dims.build_mesh("cpu")
    model = build_model(config, ARGS, dims, mesh, torch.device("cpu"))
    single = ParallelDims(1, 1, 1, 1, 1, world_size=1, enable_loss_parallel=False)
    ref = build_model(config, ARGS, single, None, torch.device("cpu"))
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p), r, rtol=0, atol=0, msg=f"init differs: {name}")
    dp_axis = dims.axis_name("dp")
    dp_rank = 0 if dp_axis is None else mesh[dp_axis].get_local_rank()
    losses, norms, comms, grads = _train(model, dims, dp_rank)
    ref_losses, ref_norms, _, ref_grads = _train(ref, single, 0)
    losses = torch.stack(losses)
    if dp_axis is not None:
        dist.all_reduce(losses, group=mesh[dp_axis].get_group())
        losses /= dims.dp_degree
    torch.testing.assert_close(losses, torch.stack(ref_losses), **TOL)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOL)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], **TOL, msg=f"grad differs: {name}")
    return comms


@pytest.mark.parametrize(
    "world, tp, loss_parallel_on, async_tp",
    [
        (2, 2, True, False),
        (2, 2, False, False),
        (4, 4, True, False),
        (4, 2, True, False),  # FSDP2 x TP2: 2-D parameters (dp_shard, tp)
        (2, 2, True, True),  # our ring async TP
        (4, 2, True, True),  # FSDP2 x async TP2
    ],
    ids=["tp2", "tp2-no-loss-parallel", "tp4", "fsdp2xtp2", "async-tp2", "fsdp2xasync-tp2"],
)
def test_tp_matches_single_process(world, tp, loss_parallel_on, async_tp):
    comms = run_distributed(_check, world, tp, loss_parallel_on, async_tp)
    for per_rank in comms:  # the grad norm is reduced once, over all axes, whatever the layout
        assert per_rank == [1] * STEPS


def _block_comms(rank: int, world: int):
    """One sync TP+SP block vs the same block unsharded: output, input grad, weight grads, collectives."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from torchtitan.distributed.tensor_parallel.plan import block_plan
    from torchtitan.models.llama.model import TransformerBlock, compute_rope_cache

    torch.manual_seed(0)
    ref = TransformerBlock(0, ARGS)
    for p in ref.parameters():  # non-trivial norm weights too
        torch.nn.init.normal_(p, std=0.1)
    block = copy.deepcopy(ref)
    parallelize_module(block, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), block_plan())
    x_full = torch.randn(2, SEQ, ARGS.dim)
    rope = compute_rope_cache(ARGS.head_dim, SEQ, 10000.0)
    shard = SEQ // world
    x = x_full[:, rank * shard : (rank + 1) * shard].clone().requires_grad_()  # this rank's sequence shard
    counts = {}
    for phase in ("forward", "backward"):
        with CommDebugMode() as comm:
            if phase == "forward":
                out = block(x, rope)
            else:
                out.sum().backward()
        counts[phase] = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    x_ref = x_full.clone().requires_grad_()
    out_ref = ref(x_ref, rope)
    out_ref.sum().backward()
    torch.testing.assert_close(out, out_ref[:, rank * shard : (rank + 1) * shard], **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad[:, rank * shard : (rank + 1) * shard], **TOL)
    pending = sorted(n for n, p in block.named_parameters() if any(pl.is_partial() for pl in p.grad.placements))
    for (name, p), p_ref in zip(block.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, **TOL, msg=f"grad differs: {name}")
    return counts, tuple(out.shape), pending


@pytest.mark.parametrize("world", [2, 4])
def test_block_parity_collectives_and_sequence_sharding(world):
    for counts, out_shape, pending in run_distributed(_block_comms, world):
        assert out_shape == (2, SEQ // world, ARGS.dim)  # the block's output stays sequence-sharded
        # forward: gather the sequence before attention and the FFN, reduce-scatter after; no all-reduce
        assert counts["forward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
        # backward: the mirror image. The norm weights' gradients stay pending sums, finished in
        # one batched all-reduce by reduce_partial_grads_ before clipping.
        assert counts["backward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
        assert pending == ["attention_norm.weight", "ffn_norm.weight"]
