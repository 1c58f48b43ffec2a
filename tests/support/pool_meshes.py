"""A pool worker's meshes, kept from one job to the next (tests/support/pool.py).

Every job builds its world mesh with ``ParallelDims.build_mesh``, which first clears DTensor's sharding caches:
in a process that outlives its world, a cached decision holds a mesh whose groups are gone
(``clear_dtensor_caches``). In the pool that made every multi-rank job propagate its shardings afresh: measured
on a 2-rank FSDP2 job of the tiny model, ~1 s of its ~2 s per rank (foreach optimizer ops over DTensors).

So a worker keeps the mesh of each layout it has built (and so its groups, and the cache entries that name
it): a later job of the same layout in the same group gets the same mesh object, as the steps of one run do, and
the caches stay valid. ``build_mesh`` runs on the first job of each layout, without its cache clear: the caches
never name a dead group here, because a job that leaves anything else behind (a job that fails, or that made
groups of its own: a harness's ``init_device_mesh``, a checkpointer's group, a flattened axis) ends with every
group but the kept ones destroyed and the caches cleared, as before. Outside the pool's own world (a job that
made a world of its own) nothing is kept.
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import torch.distributed as dist
from torch.distributed import distributed_c10d

_KEPT: dict[tuple, Any] = {}  # layout -> its DeviceMesh
_STATE = {"world": None, "groups_made": 0}


def _groups_made() -> int:
    return distributed_c10d._world.group_count  # private; it grows by one per group made


def install(world) -> None:
    """Keep meshes built in ``world`` (the worker's default group): wrap ``ParallelDims.build_mesh``."""
    from torchtitan.distributed import parallel_dims
    from torchtitan.distributed.parallel_dims import ParallelDims

    _STATE["world"], _STATE["groups_made"] = world, _groups_made()
    real = ParallelDims.build_mesh

    def build_mesh(self, device_type: str):
        if dist.group.WORLD is not _STATE["world"] or self.world_size == 1:
            return real(self, device_type)
        key = (device_type, self.world_size, tuple(self._axes()), tuple(sorted(self._flat_axes().items())))
        if key not in _KEPT:
            made = _groups_made()
            # no cache clear: end_job clears whenever it destroys a group, so no entry names a dead one
            with mock.patch.object(parallel_dims, "clear_dtensor_caches", lambda: None):
                _KEPT[key] = real(self, device_type)
            _STATE["groups_made"] += _groups_made() - made
        return _KEPT[key]

    ParallelDims.build_mesh = build_mesh


def _kept_groups() -> set:
    groups = set()
    for mesh in _KEPT.values():
        for m in [mesh, *mesh._get_root_mesh()._flatten_mapping.values()]:
            groups.update(m.get_all_groups())
    return groups


def end_job(failed: bool) -> None:
    """After a job: keep the meshes when the job made no group but theirs; otherwise start clean."""
    from torchtitan.distributed.parallel_dims import clear_dtensor_caches

    if failed:  # a failed job may have left a kept group mid-collective
        _KEPT.clear()
    clean = not failed and _groups_made() == _STATE["groups_made"]
    if clean:
        return
    world, kept = dist.group.WORLD, _kept_groups()
    for pg in list(distributed_c10d._world.pg_map):
        if pg is not world and pg not in kept:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(pg)
    clear_dtensor_caches()
    _STATE["groups_made"] = _groups_made()
