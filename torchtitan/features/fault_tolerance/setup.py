"""Building a rank's fault-tolerance parts from the run's parts (the ``replicas`` seam's builder,
features/registry.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import TYPE_CHECKING

from torchtitan.checkpointing.state import build_model_view
from torchtitan.datasets.shard import DataShard
from torchtitan.features.fault_tolerance.heal import HealState
from torchtitan.features.fault_tolerance.lighthouse import lighthouse_address
from torchtitan.features.fault_tolerance.manager import build_manager
from torchtitan.features.fault_tolerance.positions import DataPositions
from torchtitan.features.fault_tolerance.replicas import ReplicaGroups, Replicas
from torchtitan.features.fault_tolerance.semi_sync import SemiSyncReplicas

if TYPE_CHECKING:
    from torchtitan.components.parts import CoreParts
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.mesh import WorldMesh

logger = logging.getLogger(__name__)

# What must be equal in every replica group for their steps to be one HSDP step (and a heal to fit).
_FINGERPRINT_SECTIONS = ("model", "optimizer", "training", "experimental", "float8", "activation_checkpoint")


def config_fingerprint(config: JobConfig, world_size: int) -> int:
    """A positive 60-bit hash of what the groups must share: model, training, layout, the group's size."""
    tree = config.to_dict()
    shared = {name: tree[name] for name in _FINGERPRINT_SECTIONS}
    shared["fault_tolerance"] = {k: v for k, v in tree["fault_tolerance"].items() if k != "replica_id"}
    shared["world_size"] = world_size
    digest = hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()
    return int(digest[:15], 16) or 1


def build_data_shard(world: WorldMesh, config: JobConfig) -> DataShard:
    """The ``data_shard`` seam with ``fault_tolerance.enable``: this rank's rank among every replica group's data
    ranks (the replica groups outermost, as HSDP orders its replicate dimension)."""
    rank, degree, ft = world.local_rank("dp"), world.dims.dp_degree, config.fault_tolerance
    return DataShard(ft.replica_id * degree + rank, ft.group_size * degree)


def _sets_aside_later(cfg: JobConfig) -> bool:
    """The groups share the checkpoint folder (but in semi-sync): only an explicit rollback (checkpoint.load_step)
    moves newer checkpoints aside, and only replica group 0 does; a plain resume takes the newest, and anything
    newer is a live group's save that completed meanwhile."""
    ft = cfg.fault_tolerance
    return ft.semi_sync_method is not None or (ft.replica_id == 0 and cfg.checkpoint.load_step >= 0)


def build_replicas(core: CoreParts) -> Replicas:
    """The ``group_seams`` slot with ``fault_tolerance.enable``: this rank's ``Replicas`` (``core.rank`` in its group):
    its Manager (joined to the lighthouse), heal state and data positions; the synchronous mode, or the
    semi-synchronous one the config names."""
    cfg, world, rank, optimizer = core.config, core.world, core.rank, core.optimizer
    dims, ft = world.dims, cfg.fault_tolerance
    lighthouse = lighthouse_address()
    positions = DataPositions(
        core.data_loader,
        replica_id=ft.replica_id,
        group_size=ft.group_size,
        dp_rank=world.local_rank("dp"),
        dp_degree=dims.dp_degree,
        batch_size=cfg.training.batch_size,
        accum=cfg.training.gradient_accumulation_steps,
    )
    fingerprint = config_fingerprint(cfg, dims.world_size)
    heal = HealState(
        view=build_model_view(core.model_parts),
        optimizer=optimizer,
        lr_scheduler=core.lr_scheduler,
        positions=positions,
        replica_id=ft.replica_id,
        fingerprint=fingerprint,
    )
    handle = build_manager(ft, lighthouse=lighthouse, group_rank=rank, group_world_size=dims.world_size)
    handle.manager.register_state_dict_fn("torchtitan", heal.load_state_dict, heal.state_dict)
    if rank == 0:
        logger.info(
            "fault tolerance: replica group %d of %d (%d rank%s, pid %d), lighthouse %s, min_replica_size %d, %s",
            ft.replica_id,
            ft.group_size,
            dims.world_size,
            "s" if dims.world_size > 1 else "",
            os.getpid(),
            lighthouse,
            ft.min_replica_size,
            f"{ft.semi_sync_method} every {ft.sync_steps} steps"
            if ft.semi_sync_method
            else "gradients averaged every step",
        )
    parts = dict(handle=handle, heal=heal, positions=positions, lighthouse=lighthouse, fingerprint=fingerprint)
    parts.update(sets_aside_later=_sets_aside_later(cfg))
    if ft.semi_sync_method is None:
        return ReplicaGroups(ft, **parts, log=rank == 0)
    return SemiSyncReplicas(ft, view=heal.view, optimizer=optimizer, **parts, log=rank == 0)
