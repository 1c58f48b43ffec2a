"""FSDP / HSDP / DDP against the single-process reference: init, loss, gradients, grad norm, comms."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from tests.support.distributed import run_distributed
from torchtitan.build import build_model
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.config.manager import JobConfig
from torchtitan.distributed.grad_norm import clip_grad_norm_, reduce_partial_grads_
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import ModelArgs

pytestmark = [pytest.mark.distributed, pytest.mark.pool(2)]

ARGS = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=16)
GLOBAL_BATCH, SEQ, STEPS = 8, 16, 3
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32: only the order of the gradient reduction differs


def _config(dp_replicate: int, dp_shard: int, ac_mode: str = "none", extra: tuple[str, ...] = ()) -> JobConfig:
    return JobConfig.parse_args(
        [
            *extra,
            "--training.data_parallel_replicate_degree",
            str(dp_replicate),
            "--training.data_parallel_shard_degree",
            str(dp_shard),
            "--training.mixed_precision_param",
            "float32",
            "--training.seed",
            "7",
            "--activation_checkpoint.mode",
            ac_mode,
        ]
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model, batches, dp_rank: int, dp_degree: int):
    """STEPS AdamW steps; each rank uses its slice of every global batch. Returns (losses, norms, comms)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses, norms, clip_comms = [], [], []
    per_rank = GLOBAL_BATCH // dp_degree
    for x, y in batches:
        xs, ys = x[dp_rank * per_rank : (dp_rank + 1) * per_rank], y[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        loss = cross_entropy_loss(model(xs), ys)
        loss.backward()
        reduce_partial_grads_(model.parameters())
        with CommDebugMode() as comm:
            norms.append(clip_grad_norm_(model.parameters(), max_norm=0.5).item())
        clip_comms.append(comm.get_total_counts())
        grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, norms, clip_comms, grads


def _batches():
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(0, ARGS.vocab_size, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(0, ARGS.vocab_size, (GLOBAL_BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _check_against_reference(rank: int, world: int, dp_replicate: int, dp_shard: int, ac_mode: str, extra=()):
    import torch.distributed as dist

    config = _config(dp_replicate, dp_shard, ac_mode, extra)
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world)
    mesh = dims.build_mesh("cpu")
    model = build_model(config, ARGS, dims, mesh, torch.device("cpu"))
    single = ParallelDims(1, 1, 1, 1, 1, world_size=1, enable_loss_parallel=True)
    ref = build_model(config, ARGS, single, None, torch.device("cpu"))
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p), r, rtol=0, atol=0, msg=f"init differs: {name}")
    dp_rank = mesh[dims.axis_name("dp")].get_local_rank()
    losses, norms, comms, grads = _train(model, _batches(), dp_rank, dims.dp_degree)
    ref_losses, ref_norms, _, ref_grads = _train(ref, _batches(), 0, 1)
    global_losses = []
    for loss in losses:  # the mean of the per-rank means = the global mean (equal token counts)
        dist.all_reduce(loss)
        global_losses.append(loss.item() / world)
    torch.testing.assert_close(torch.tensor(global_losses), torch.stack(ref_losses), **TOL)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOL)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], **TOL, msg=f"grad differs: {name}")
    if extra:  # how many blocks block 0 all-gathers ahead in forward
        return comms, len(model.layers["0"]._get_fsdp_state()._states_to_forward_prefetch)
    return comms


@pytest.mark.parametrize(
    "world, dp_replicate, dp_shard, ac_mode, clip_all_reduces",
    [
        (2, 1, 2, "none", 1),  # FSDP: one all-reduce of the norm over the shard axis
        (4, 1, 4, "full", 1),  # FSDP4 with full activation checkpointing
        (4, 2, 2, "none", 1),  # HSDP: the norm is reduced over the shard axis only
        (2, 2, 1, "none", 0),  # DDP: gradients are already replicated, the norm needs no communication
    ],
)
def test_data_parallel_matches_single_process(world, dp_replicate, dp_shard, ac_mode, clip_all_reduces):
    comms = run_distributed(_check_against_reference, world, dp_replicate, dp_shard, ac_mode)
    for per_rank in comms:
        assert per_rank == [clip_all_reduces] * STEPS


def test_fsdp_prefetch_reshard_and_offload_controls_keep_parity():
    extra = (
        "--training.fsdp_prefetch_depth",
        "2",
        "--training.fsdp_reshard_after_forward",
        "never",
        "--training.enable_cpu_offload",
    )
    for comms, forward_prefetch in run_distributed(_check_against_reference, 2, 1, 2, "none", extra):
        assert comms == [1] * STEPS
        assert forward_prefetch == 2  # block 0 of the 3-block model gathers blocks 1 and 2 ahead
