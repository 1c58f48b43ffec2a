"""The torchft Manager of one rank of one replica group.

Rank r of every replica group joins the same cross-group process group (torchft reconfigures it at each
quorum change), so group rank r's shards are averaged with the same shards of the other groups. Group rank 0
runs the group's ManagerServer, which speaks to the lighthouse for the whole group.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from torchtitan.features.fault_tolerance.errors import ReplicaGroupsFailed, require_torchft, short_reason
from torchtitan.features.fault_tolerance.lighthouse import wait_for_lighthouse

if TYPE_CHECKING:
    from torchft import Manager

    from torchtitan.config.sections.fault_tolerance import FaultTolerance


def replica_name(replica_id: int) -> str:
    """The id the lighthouse knows a group by: zero-padded, so its order is the numeric order (torchft reads
    the trailing digits as the group's number)."""
    return f"torchtitan_ft_{replica_id:05d}"


class QuorumEvents(logging.Handler):
    """The quorum's id and step, from torchft's structured event logger ``torchft_quorums`` (one record per new
    quorum, with the step the quorum is at: the step a group behind it heals to). Kept off the console."""

    def __init__(self, replica: str):
        super().__init__(level=logging.INFO)
        self.replica = replica
        self.latest: tuple[int, int] | None = None  # (quorum id, its step)

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "replica_id", None) == self.replica:
            self.latest = (int(record.quorum_id), int(record.step))

    def attach(self) -> QuorumEvents:
        events = logging.getLogger("torchft_quorums")
        events.setLevel(logging.INFO)
        events.propagate = False
        events.addHandler(self)
        return self

    def detach(self) -> None:
        logging.getLogger("torchft_quorums").removeHandler(self)


@dataclass
class ManagerHandle:
    """The Manager and what must outlive it: the group's store (hosted on group rank 0), the process group, the
    quorum events."""

    manager: Manager
    pg: Any
    store: Any
    events: QuorumEvents

    def close(self) -> None:
        self.events.detach()
        self.manager.shutdown(wait=False)
        self.pg.abort(errored=False)


def build_manager(
    ft: FaultTolerance,
    *,
    lighthouse: str,
    group_rank: int,
    group_world_size: int,
) -> ManagerHandle:
    """This rank's Manager, over gloo (or NCCL) between the replica groups, with a synchronous quorum.

    What a healing group receives is registered afterwards (``Manager.register_state_dict_fn``): the trainer's
    state (heal.py) and, in the semi-synchronous modes, the step and torchft's own DiLoCo state.

    The quorum is synchronous (``use_async_quorum=False``): ``start_quorum`` returns once the quorum is formed
    and, on a group that heals, once the peer's state is loaded, so a healed group's forward pass already runs
    on the live weights and the group takes part in that step's all-reduce. ``init_sync=False``: initial
    weights are a function of the seed, so groups that start together need no transfer at step 0 (the first
    step checks that every group runs the same config, ``replicas.ReplicaGroups``).

    Raises:
        ReplicaGroupsFailed: the lighthouse did not answer within ``fault_tolerance.quorum_timeout_seconds``.
    """
    torchft = require_torchft()
    wait_for_lighthouse(lighthouse, ft.quorum_timeout_seconds)
    store, host, port = _group_store(group_rank, group_world_size)
    pg_timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
    pg = torchft.ProcessGroupGloo(timeout=pg_timeout) if ft.process_group == "gloo" else None
    if pg is None:
        pg = torchft.ProcessGroupNCCL(timeout=pg_timeout)  # the pre-launch check made sure CUDA exists
    wait = timedelta(seconds=ft.quorum_timeout_seconds)
    events = QuorumEvents(replica_name(ft.replica_id)).attach()
    try:
        manager = torchft.Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=ft.min_replica_size,
            use_async_quorum=False,
            timeout=wait,  # should_commit, the heal transfer
            quorum_timeout=wait,
            connect_timeout=wait,
            rank=group_rank,
            world_size=group_world_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=lighthouse,
            replica_id=replica_name(ft.replica_id),
            init_sync=False,
            checkpoint_transport=_quiet_http_transport(torchft, wait),
        )
    except RuntimeError as e:  # the lighthouse went away between the probe and the ManagerServer's connection
        events.detach()
        why = short_reason(e)
        raise ReplicaGroupsFailed(f"fault tolerance: cannot join the lighthouse at {lighthouse}: {why}") from None
    return ManagerHandle(manager, pg, store, events)


def _quiet_http_transport(torchft: Any, timeout: timedelta) -> Any:
    """torchft's default heal transport (HTTP, what the Manager would build), without http.server's line on
    stderr for every request: the trainer logs a heal in one line. Its handler class is made per transport
    (torchft 0.2.0 keeps it on the private server), so only this transport's requests go quiet."""
    from torchft.checkpointing import HTTPTransport

    transport = HTTPTransport(timeout=timeout, num_chunks=0)
    transport._server.RequestHandlerClass.log_message = lambda *args, **kwargs: None
    return transport


def _group_store(group_rank: int, group_world_size: int) -> tuple[Any, str, int]:
    """A fresh TCPStore for this group's Manager, hosted by group rank 0: (store on rank 0 else None, host, port).

    Not torchrun's store: torchft writes fixed, unprefixed keys, which a second job in the same processes
    (or a restarted rank) would read stale. Other groups reach it too (the quorum's process group meets in the
    first group's store), so it advertises MASTER_ADDR (torchrun's) or this machine's name.
    """
    from torch.distributed import TCPStore

    store = None
    if group_rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        where = [host, store.port]
    else:
        where = [None, None]
    if group_world_size > 1:
        dist.broadcast_object_list(where, src=0)
    return store, where[0], int(where[1])
