"""Fault tolerance across replica groups with torchft 0.2.0: lighthouse, Manager, fault-tolerant gradient sync.

Groundwork only: nothing here is called by the trainer yet (docs/fault_tolerance.md lists what wiring needs).
A *replica group* is one ordinary launch (one or more ranks, possibly sharded inside); groups are joined
by a lighthouse that forms a quorum each step. Gradients are averaged across the live groups through the
Manager's fault-tolerant all-reduce, and the optimizer steps only when the quorum agrees to commit, so a
group that dies mid-step costs the survivors one uncommitted step, not a restart. A restarted group heals
from a live peer (weights, optimizer state, step) through torchft's checkpoint transport.

torchft is an optional extra: this module imports without it and raises one ImportError line when used.
"""

from __future__ import annotations

import logging
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchft import Manager

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    'fault tolerance needs torchft, which is not installed; install the optional extra: pip install -e ".[ft]"'
)

# The lighthouse logs "Lighthouse listening on: http://HOST:PORT"; HOST is the machine's name, not the bind
# address, so only the port is read and the address is rebuilt from the bind host.
_LISTENING = re.compile(r"Lighthouse listening on: \S+:(\d+)")


def _require_torchft() -> Any:
    try:
        import torchft
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return torchft


def start_lighthouse(
    min_replicas: int,
    port: int = 0,
    *,
    host: str = "127.0.0.1",
    join_timeout_ms: int = 60_000,
    heartbeat_timeout_ms: int = 5_000,
    quorum_tick_ms: int = 100,
    startup_timeout_s: float = 30.0,
) -> tuple[subprocess.Popen, str]:
    """Start torchft's lighthouse in a child process (for tests and local demos); returns (process, address).

    The address is what replicas take as `lighthouse_addr` (or TORCHFT_LIGHTHOUSE). The caller owns the
    process: `process.kill(); process.wait()` when done.

    Args:
        min_replicas: replica groups a quorum needs before it forms.
        port: 0 picks a free port.
        host: the bind address; loopback by default.
        join_timeout_ms: how long a quorum waits for replicas that heartbeat but have not asked to join.
        heartbeat_timeout_ms: silence after which a replica counts as dead (how fast survivors shrink).
        quorum_tick_ms: how often the lighthouse re-checks a pending quorum.

    Raises:
        ImportError: torchft is not installed.
        RuntimeError: the lighthouse exited or did not report its port within startup_timeout_s.
    """
    _require_torchft()
    # The console script, beside this interpreter first so it is this interpreter's torchft. Its Rust main
    # parses the process's own argv, so `python -c "...lighthouse_main()"` cannot stand in for it.
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    script = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if script is None:
        raise RuntimeError("torchft is installed but its console script torchft_lighthouse is not on PATH")
    args = [f"--min_replicas={min_replicas}", f"--bind={host}:{port}", f"--join_timeout_ms={join_timeout_ms}"]
    args += [f"--heartbeat_timeout_ms={heartbeat_timeout_ms}", f"--quorum_tick_ms={quorum_tick_ms}"]
    process = subprocess.Popen([script, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found: queue.Queue[str] = queue.Queue()
    # The lighthouse logs a status line every tick: the pipe must be drained for its whole life or it blocks.
    threading.Thread(target=_drain_lighthouse_log, args=(process, found), daemon=True).start()
    try:
        bound_port = found.get(timeout=startup_timeout_s)
    except queue.Empty:
        bound_port = ""
    if not bound_port:
        process.kill()
        process.wait(timeout=10)
        raise RuntimeError(
            f"torchft lighthouse (min_replicas={min_replicas}, bind {host}:{port}) did not start within "
            f"{startup_timeout_s:.0f}s (exit code {process.returncode})"
        ) from None
    return process, f"http://{host}:{bound_port}"


def _drain_lighthouse_log(process: subprocess.Popen, found: queue.Queue[str]) -> None:
    assert process.stderr is not None
    for line in process.stderr:
        match = _LISTENING.search(line)
        if match:
            found.put(match.group(1))
        if "Quorum status" not in line:  # the per-tick status lines would drown the log
            logger.debug("lighthouse: %s", line.rstrip())
    found.put("")  # exited: wake the starter at once instead of at its timeout


def build_ft_manager(
    replica_id: int,
    *,
    group_rank: int,
    group_world_size: int,
    state_dict_fn: Callable[[], dict[str, Any]],
    load_state_dict_fn: Callable[[dict[str, Any]], None],
    min_replica_size: int,
    timeout: timedelta,
    quorum_timeout: timedelta | None = None,
    lighthouse_addr: str | None = None,
    store_addr: str | None = None,
    store_port: int | None = None,
    hostname: str | None = None,
) -> Manager:
    """Build the torchft Manager of one rank of replica group `replica_id`, over gloo across the groups.

    The Manager runs a synchronous quorum (use_async_quorum=False): start_quorum returns only once the
    quorum is formed and, on a group that heals, once the peer's state is loaded, so the forward pass of a
    healed group already runs on the live weights and the group can take part in that step's all-reduce.

    Args:
        replica_id: this group's id; the lighthouse keys groups by it, so a restarted group reuses it.
        group_rank: this rank inside its replica group; rank 0 runs the group's ManagerServer.
        group_world_size: ranks in the replica group.
        state_dict_fn: what a healing peer receives (model, optimizer, schedule, dataloader position).
        load_state_dict_fn: applies that state on the healing group, at its next start_quorum.
        min_replica_size: live groups a step needs to commit; fewer and every group discards the step.
        timeout: the all-reduce, should_commit and checkpoint-transfer timeout (how long a dead peer can
            stall a step before it is discarded).
        quorum_timeout: how long start_quorum waits for a quorum; defaults to `timeout`.
        lighthouse_addr: defaults to torchft's TORCHFT_LIGHTHOUSE.
        store_addr, store_port: this group's TCPStore; default to MASTER_ADDR / MASTER_PORT (torchrun's).
        hostname: the name peers reach this group's ManagerServer by; defaults to this machine's name.
    """
    torchft = _require_torchft()
    extra = {} if hostname is None else {"hostname": hostname}
    return torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict_fn,
        state_dict=state_dict_fn,
        min_replica_size=min_replica_size,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=quorum_timeout or timeout,
        connect_timeout=timeout,
        rank=group_rank,
        world_size=group_world_size,
        store_addr=store_addr,
        store_port=store_port,
        lighthouse_addr=lighthouse_addr,
        replica_id=str(replica_id),
        **extra,
    )


def ft_allreduce_grads_(params: Iterable[torch.nn.Parameter], manager: Manager) -> None:
    """Average the gradients of `params` in place across the live replica groups.

    A failed all-reduce does not raise: the Manager records the error, should_commit then returns False
    on every group and the (possibly corrupt) gradients must not be used. A parameter without a gradient
    is all-reduced as zeros (and keeps them), so every group issues the same collectives in the same order.
    DTensor gradients (FSDP/TP inside the group) are reduced shard by shard: group rank r of every replica
    group holds the same shard, and the Manager's gloo group joins exactly those ranks.
    """
    works = []
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # DTensor: its shard, shared storage
        works.append(manager.allreduce(local))
    for work in works:
        work.wait()


@dataclass(frozen=True)
class FtStepResult:
    """What one ft_step attempt did."""

    step: int
    """The quorum's step this attempt trained (the manager's step before the commit)."""
    committed: bool
    """Whether the optimizer stepped; False when a peer failed mid-step or too few groups were live."""
    num_participants: int
    """Replica groups in this step's quorum."""
    loss: float
    quorum_s: float
    """Seconds start_quorum took (includes a heal on a group that rejoins)."""
    healed: bool
    """Whether this group loaded a peer's state and jumped to its step at this quorum (the step-0 sync of
    init_sync loads a peer's state without a jump and is not counted)."""


def ft_step(
    manager: Manager, optimizer: torch.optim.Optimizer, forward_backward: Callable[[int], torch.Tensor]
) -> FtStepResult:
    """One fault-tolerant training step: quorum, forward/backward, all-reduce, commit, optimizer step.

    `forward_backward(step)` computes the loss of this group's batch for quorum step `step` and calls
    backward; it runs after the quorum because a healing group only has the live weights (and the right
    step for its data) once start_quorum returns. The optimizer steps only if should_commit agrees.
    """
    step_before = manager.current_step()
    start = time.perf_counter()
    manager.start_quorum()
    quorum_s = time.perf_counter() - start
    step = manager.current_step()  # a healed group jumps to the quorum's step here
    optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(step)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ft_allreduce_grads_(params, manager)
    committed = manager.should_commit()
    if committed:
        optimizer.step()
    else:
        logger.warning(
            "step %d not committed (%d replica groups in quorum, error: %s)",
            step,
            manager.num_participants(),
            manager.errored(),
        )
    return FtStepResult(
        step=step,
        committed=committed,
        num_participants=manager.num_participants(),
        loss=loss.item(),
        quorum_s=quorum_s,
        healed=step != step_before,
    )
