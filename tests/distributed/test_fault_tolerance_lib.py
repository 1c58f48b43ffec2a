"""torchtitan.distributed.fault_tolerance against a single-process reference: 2 replica groups x 1 rank on gloo.

Each replica group is its own spawned process (a group is a separate launch in real use, and the kill test
needs a process to kill); the lighthouse is a third. Skipped where torchft (the `ft` extra) is not installed.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("torchft")

from torchtitan.distributed.fault_tolerance import build_ft_manager, ft_step, start_lighthouse  # noqa: E402

pytestmark = [pytest.mark.distributed]

DIM, PER_REPLICA_BATCH, LR, MOMENTUM = 8, 4, 0.1, 0.9
DEADLINE_S = 60  # every wait in this module ends by then; a stuck run fails instead of hanging CI


def _model(seed: int) -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(DIM, DIM)
    # momentum: the optimizer has state, so a heal that forgot it would show in the final weights
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch, the same in every process: replica r trains on rows [r*B, (r+1)*B)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(2 * PER_REPLICA_BATCH, DIM, generator=gen)  # (2B, dim)
    return x, torch.randn(2 * PER_REPLICA_BATCH, DIM, generator=gen)


def _loss(model: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)  # mean over rows: equal halves average to the whole


def _weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}


def _replica(replica_id: int, lighthouse: str, opts: dict, out: mp.Queue, events: dict) -> None:
    """One replica group (1 rank): train until the manager's step reaches opts['steps'], report to `out`."""
    from torch.distributed import TCPStore

    model, optimizer = _model(seed=opts.get("seed", 0))

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = build_ft_manager(
        replica_id,
        group_rank=0,
        group_world_size=1,
        state_dict_fn=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        load_state_dict_fn=load_state_dict,
        min_replica_size=opts["min_replica_size"],
        timeout=timedelta(seconds=10),
        lighthouse_addr=lighthouse,
        store_addr="127.0.0.1",
        store_port=store.port,
        hostname="127.0.0.1",
    )

    def forward_backward(step: int) -> torch.Tensor:
        x, y = _global_batch(step)
        rows = slice(replica_id * PER_REPLICA_BATCH, (replica_id + 1) * PER_REPLICA_BATCH)
        loss = _loss(model, x[rows], y[rows])
        loss.backward()
        if step == opts.get("die_at_step"):
            out.put(("dying", replica_id, step))
            events["never"].wait(DEADLINE_S)  # the parent SIGKILLs this process mid-step, before the all-reduce
        return loss

    # The manager heartbeats from here on, so a quorum waits (up to join_timeout_ms) for this group.
    if "start" in opts:
        opts["start"].wait(DEADLINE_S)  # both first launches in the first quorum
    if opts.get("restarted"):
        events["rejoin"].set()
    log = []
    wait_rejoin_after = opts.get("wait_rejoin_after")  # the survivor: pause once alone, until the restart
    try:
        while manager.current_step() < opts["steps"]:
            result = ft_step(manager, optimizer, forward_backward)
            log.append(result)
            alone = result.committed and result.num_participants == 1
            if wait_rejoin_after is not None and alone and result.step > wait_rejoin_after:
                out.put(("alone", replica_id, result.step))
                wait_rejoin_after = None
                assert events["rejoin"].wait(DEADLINE_S), "the restarted replica never came back"
    finally:
        manager.shutdown(wait=False)
    out.put(("done", replica_id, {"log": log, "weights": _weights(model), "step": manager.current_step()}))


def _reference(steps: int) -> dict[str, np.ndarray]:
    """One process on the whole global batch: what averaged gradients over the two halves must reproduce."""
    model, optimizer = _model(seed=0)
    for step in range(steps):
        optimizer.zero_grad()
        _loss(model, *_global_batch(step)).backward()
        optimizer.step()
    return _weights(model)


@dataclass
class _Launch:
    """One replica process and its own message queue: a process SIGKILLed while its queue's feeder thread
    held the queue's lock would block every other writer of a shared queue."""

    proc: Any
    out: Any

    def next(self, kind: str) -> tuple:
        try:
            msg = self.out.get(timeout=DEADLINE_S)
        except queue.Empty:
            raise AssertionError(f"no '{kind}' message within {DEADLINE_S}s") from None
        assert msg[0] == kind, f"expected '{kind}', got {msg[:2]}"
        return msg[1:]


class _Run:
    """A lighthouse and replica processes; everything started is killed on exit, every wait is bounded."""

    def __init__(self, min_replicas: int, **lighthouse_opts) -> None:
        self.ctx = mp.get_context("spawn")
        self.launches: list[_Launch] = []
        self.lighthouse, self.address = start_lighthouse(min_replicas, **lighthouse_opts)

    def start(self, replica_id: int, opts: dict, events: dict | None = None) -> _Launch:
        out = self.ctx.Queue()
        proc = self.ctx.Process(target=_replica, args=(replica_id, self.address, opts, out, events or {}))
        proc.start()
        self.launches.append(_Launch(proc, out))
        return self.launches[-1]

    def close(self) -> None:
        for launch in self.launches:
            launch.proc.join(timeout=10)
            if launch.proc.is_alive():
                launch.proc.kill()
                launch.proc.join(timeout=10)
        self.lighthouse.kill()
        self.lighthouse.wait(timeout=10)


def test_two_replica_groups_match_single_process_on_the_whole_batch():
    steps = 4
    run = _Run(min_replicas=2)
    try:
        launches = [run.start(replica_id, {"steps": steps, "min_replica_size": 2}) for replica_id in (0, 1)]
        done = dict(launch.next("done") for launch in launches)
    finally:
        run.close()
    expected = _reference(steps)
    for replica_id in (0, 1):
        log = done[replica_id]["log"]
        assert [(r.step, r.committed, r.num_participants) for r in log] == [(s, True, 2) for s in range(steps)]
        for name, value in expected.items():
            np.testing.assert_allclose(done[replica_id]["weights"][name], value, rtol=0, atol=1e-6, err_msg=name)
    print(f"\nquorum seconds, replica 0: {[round(r.quorum_s, 3) for r in done[0]['log']]}")


def test_killed_replica_group_survivor_continues_and_restart_heals_bit_identical():
    kill_step, steps = 2, 8
    # min_replicas=1 lets the survivor commit alone; a 1 s heartbeat timeout makes it drop the dead group fast
    run = _Run(min_replicas=1, heartbeat_timeout_ms=1000, join_timeout_ms=10_000)
    ctx = run.ctx
    events = {"rejoin": ctx.Event(), "never": ctx.Event()}
    try:
        start = ctx.Barrier(2, timeout=DEADLINE_S)
        common = {"steps": steps, "min_replica_size": 1}
        survivor = run.start(0, {**common, "start": start, "wait_rejoin_after": kill_step}, events)
        victim = run.start(1, {**common, "start": start, "die_at_step": kill_step}, events)
        assert victim.next("dying") == (1, kill_step)
        victim.proc.kill()  # SIGKILL from outside, mid-step: the survivor is waiting in that step's all-reduce
        victim.proc.join(timeout=10)
        assert survivor.next("alone")[0] == 0
        # restarted with another seed: equal weights at the end can only come from healing
        restarted = run.start(1, {**common, "seed": 123, "restarted": True}, events)
        done = dict(launch.next("done") for launch in (survivor, restarted))
    finally:
        run.close()
    survivor_log, rejoined_log = done[0]["log"], done[1]["log"]
    assert survivor.proc.exitcode == 0
    failed = [r.step for r in survivor_log if not r.committed]
    assert kill_step in failed, survivor_log
    committed = [r.step for r in survivor_log if r.committed]
    assert committed == list(range(steps)), "every step committed exactly once on the survivor"
    assert any(r.num_participants == 1 for r in survivor_log if r.committed)
    first = rejoined_log[0]
    assert first.healed and first.step > kill_step and first.num_participants == 2, rejoined_log
    assert done[0]["step"] == done[1]["step"] == steps
    for name, value in done[0]["weights"].items():
        assert np.array_equal(done[1]["weights"][name], value), name
    print(
        f"\nsurvivor: uncommitted steps {failed}; quorum seconds {[round(r.quorum_s, 2) for r in survivor_log]}"
        f"\nrestarted: healed at step {first.step} in {first.quorum_s:.3f}s (quorum + checkpoint transfer)"
    )
