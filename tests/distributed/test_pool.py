"""The worker pool every multi-process test runs in (tests/support/pool.py): reuse, failures, hangs, isolation."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

from tests.support.pool import PoolBroken, run_in_pool

pytestmark = [pytest.mark.distributed, pytest.mark.pool(2)]


def _rank_pid_sum(rank: int, world: int, x: int) -> tuple[int, int]:
    t = torch.tensor([rank + x])
    dist.all_reduce(t)
    return os.getpid(), int(t.item())


def _raise_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    return rank


def _rank_0_waits_alone(rank: int, world: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: stuck until the pool is killed


def _leave_state_behind(rank: int, world: int) -> int:
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float64)
    group = dist.new_group(list(range(world)))
    # used once, so every rank has finished connecting before any rank's end of job destroys it (gloo: a rank whose
    # side of the handshake was done returned, destroyed the group, and its peer's connect read "Connection closed
    # by peer", once in CI at load 20)
    dist.barrier(group=group)
    return len(dist.distributed_c10d._world.pg_map)


def _state(rank: int, world: int) -> tuple[bool, torch.dtype, int]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.get_default_dtype(),
        len(dist.distributed_c10d._world.pg_map),
    )


def test_jobs_reuse_the_ranks_and_return_by_rank():
    first = run_in_pool(_rank_pid_sum, 2, 10)
    second = run_in_pool(_rank_pid_sum, 2, 0)
    assert [s for _, s in first] == [21, 21] and [s for _, s in second] == [1, 1]
    assert [p for p, _ in first] == [p for p, _ in second]  # the same two processes
    assert len({p for p, _ in first}) == 2


def test_a_failed_job_names_its_rank_and_the_pool_goes_on():
    before = [p for p, _ in run_in_pool(_rank_pid_sum, 2, 0)]
    with pytest.raises(RuntimeError, match="(?s)rank 1:.*planted failure on rank 1"):
        run_in_pool(_raise_on_rank_1, 2)
    after = [p for p, _ in run_in_pool(_rank_pid_sum, 2, 0)]
    assert after == before  # still in step (the ping), so not restarted


def test_a_hung_job_kills_the_pool_and_the_next_job_gets_fresh_ranks():
    before = [p for p, _ in run_in_pool(_rank_pid_sum, 2, 0)]
    with pytest.raises(PoolBroken, match="exceeded 3s") as broken:
        run_in_pool(_rank_0_waits_alone, 2, timeout_s=3)
    # before the kill, each rank wrote its stacks: rank 0's names the collective it is stuck in
    assert re.search(r"(?s)--- rank 0 output.*line \d+ in _rank_0_waits_alone", str(broken.value))
    again = run_in_pool(_rank_pid_sum, 2, 5)
    assert [s for _, s in again] == [11, 11]
    assert not set(before) & {p for p, _ in again}  # new processes


def test_what_a_job_leaves_behind_is_reset_before_the_next():
    groups = run_in_pool(_state, 2)[0][2]
    assert run_in_pool(_leave_state_behind, 2) == [groups + 1] * 2
    assert run_in_pool(_state, 2) == [(False, torch.float32, groups)] * 2


def _mesh_of_a_job(rank: int, world: int, also: str = "") -> tuple[bool, int]:
    """(whether an earlier job had this job's mesh object, a sharded sum over it); ``also``: leave a group, or fail."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchtitan.distributed.parallel_dims import ParallelDims

    mesh = ParallelDims(1, world, 1, 1, 1, world_size=world, enable_loss_parallel=True).build_mesh("cpu")
    seen, mesh.seen_by_test_pool = getattr(mesh, "seen_by_test_pool", False), True
    total = int(distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]).sum().full_tensor().item())
    if also == "group":
        dist.barrier(group=dist.new_group(list(range(world))))  # connected on every rank before it is destroyed
    if also == "fail":
        raise ValueError("planted failure")
    return seen, total


def test_a_layout_keeps_its_mesh_until_a_job_fails():
    """tests/support/pool_meshes.py: the same mesh object for the next job of a layout, also after a job that made a group
    of its own (that group is destroyed, the caches cleared); a failed job drops it."""
    groups = run_in_pool(_state, 2)[0][2]
    run_in_pool(_mesh_of_a_job, 2)
    assert run_in_pool(_mesh_of_a_job, 2, "group") == [(True, 6)] * 2
    assert run_in_pool(_state, 2)[0][2] == groups  # the job's own group did not reach the next
    assert run_in_pool(_mesh_of_a_job, 2) == [(True, 6)] * 2  # the caches were cleared, the kept mesh still works
    with pytest.raises(RuntimeError, match="planted failure"):
        run_in_pool(_mesh_of_a_job, 2, "fail")
    assert run_in_pool(_mesh_of_a_job, 2) == [(False, 6)] * 2  # built again after the failure
