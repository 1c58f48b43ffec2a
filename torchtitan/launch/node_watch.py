"""A lost node is one line: the launchers of a multi-node run watch each other through the rendezvous store.

torchrun's agents notice a node that died (SIGKILL, power, network) only when their ranks fail on it, with a
collective's or the rendezvous store's traceback, or, where the dead node sends no TCP reset, when a collective
times out minutes later. So, in a fixed-size multi-node c10d launch (``--nnodes N``, N > 1, ``--rdzv_backend
c10d``, no ``--max-restarts``), each launcher runs ``NodeWatch``, a daemon thread with a client of the
rendezvous's own TCP store (under ``torchtitan/node_watch/<rdzv_id>/``):

* at start each launcher registers (host, pid, whether it hosts the store) and learns the store host's entry;
* every ``BEAT_S`` it adds 1 to its own counter and reads the next node's (node i watches node i + 1, in the
  order they registered: 2 store operations a node a second, whatever the number of nodes);
* a counter that has not moved for ``LOST_AFTER_S``, from a node that did not say it left (a launcher that ends,
  well or not, says so first), is a lost node: the watcher publishes it, and every launcher, seeing the entry
  at its next beat, SIGKILLs its own ranks (they cannot finish a step without the lost ones) so that torchrun
  ends now;
* a store that stops answering means the node hosting it is lost (the rendezvous dies with it).

The launcher then prints ``lost_node_line``: the node, and the checkpoint the same command resumes from.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

BEAT_S = 1.0
LOST_AFTER_S = 3.0  # a counter unchanged this long: its launcher is gone
STORE_TIMEOUT_S = 5.0  # a store operation that takes longer: the store's node is gone


@dataclass(frozen=True)
class LostNode:
    host: str
    pid: int
    """The lost node's launcher's pid."""
    hosted_store: bool
    """It hosted the rendezvous store, which is gone with it."""


def watch_applies(args) -> bool:
    """A fixed-size multi-node c10d launch that does not restart (torchrun's parsed ``args``)."""
    from torch.distributed.run import parse_min_max_nnodes

    low, high = parse_min_max_nnodes(str(args.nnodes))
    return low == high > 1 and args.rdzv_backend == "c10d" and int(args.max_restarts) == 0


class NodeWatch:
    """The watch of one launcher; ``start`` it before torchrun's ``run``, ``stop`` it after (with how it ended)."""

    def __init__(self, endpoint: str, run_id: str, nnodes: int):
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        self.host, self.port = parse_rendezvous_endpoint(endpoint, default_port=29400)
        self.endpoint, self.prefix, self.nnodes = endpoint, f"torchtitan/node_watch/{run_id}/", nnodes
        self.me = {"host": socket.gethostname(), "pid": os.getpid()}
        self.lost: LostNode | None = None
        self.found = threading.Event()  # set once ``lost`` is known
        self._stop = threading.Event()
        self._store = None
        self._index = 0
        self._store_host: LostNode | None = None
        self._store_host_index: int | None = None
        self._store_host_left = False
        self._thread = threading.Thread(target=self._run, name="torchtitan-node-watch", daemon=True)

    def start(self) -> NodeWatch:
        self._thread.start()
        return self

    def verdict(self, wait_s: float) -> LostNode | None:
        """The lost node, waiting up to ``wait_s`` for the watch to decide (the ranks often fail first)."""
        self.found.wait(wait_s)
        return self.lost

    def stop(self, why: str) -> None:
        """Say this launcher leaves (``why``), so no watcher takes it for lost; end the thread."""
        self._stop.set()
        self._thread.join(timeout=2 * STORE_TIMEOUT_S)
        if self._store is not None:
            try:
                self._store.set(self._key(f"left/{self._index}"), why)
            except Exception:  # noqa: BLE001 - the store may be gone already; nothing to tell then
                pass

    # ---- the thread --------------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _run(self) -> None:
        try:
            if not self._join():
                return
            self._beat()
        except Exception:  # noqa: BLE001 - the store stopped answering: the node that hosts it is gone
            if not self._stop.is_set() and self._store_host is not None and not self._store_host_left:
                self._declare(self._store_host)

    def _join(self) -> bool:
        from torch.distributed import TCPStore

        while self._store is None:  # the store exists once its host's agent started the rendezvous
            if self._stop.is_set():
                return False
            try:
                self._store = TCPStore(
                    self.host, self.port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S),
                    wait_for_workers=False,
                )  # fmt: skip
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(BEAT_S)
        store = self._store
        self._index = store.add(self._key("count"), 1) - 1
        entry = {**self.me, "store": self._hosts_store(), "index": self._index}
        store.set(self._key(f"node/{self._index}"), json.dumps(entry))
        if entry["store"]:
            store.set(self._key("store_host"), json.dumps(entry))
        while store.add(self._key("count"), 0) < self.nnodes:  # every node registered
            if self._stop.wait(BEAT_S / 4):
                return False
        if store.check([self._key("store_host")]):  # found where /proc tells (Linux)
            entry = store.get(self._key("store_host"))
            self._store_host, self._store_host_index = _lost(entry), json.loads(entry)["index"]
        return True

    def _beat(self) -> None:
        store, watched = self._store, (self._index + 1) % self.nnodes
        seen, since = -1, time.monotonic()
        while not self._stop.wait(BEAT_S):
            store.add(self._key(f"beat/{self._index}"), 1)
            if self._store_host_index is not None:  # a store host that ends on its own is not lost
                self._store_host_left = store.check([self._key(f"left/{self._store_host_index}")])
            if store.check([self._key("lost")]):
                self._declare(_lost(store.get(self._key("lost"))))
                return
            count = store.add(self._key(f"beat/{watched}"), 0)
            if count != seen:
                seen, since = count, time.monotonic()
            elif time.monotonic() - since > LOST_AFTER_S and not store.check([self._key(f"left/{watched}")]):
                entry = store.get(self._key(f"node/{watched}"))
                store.set(self._key("lost"), entry)
                self._declare(_lost(entry))
                return

    def _declare(self, lost: LostNode) -> None:
        self.lost = lost
        kill_children()  # this node's ranks: they cannot finish a step without the lost node's
        self.found.set()

    def _hosts_store(self) -> bool:
        """Whether this process listens on the store's port (Linux: its sockets in /proc; elsewhere False)."""
        return self.port in _listening_ports()


def _lost(raw: bytes) -> LostNode:
    entry = json.loads(raw)
    return LostNode(entry["host"], int(entry["pid"]), bool(entry["store"]))


def kill_children() -> None:
    """SIGKILL this process's children (torchrun's ranks); Linux only (through /proc), else nothing."""
    me = os.getpid()
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rpartition(")")[2].split()[1])
            if parent == me:
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass


def _pids() -> list[int]:
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def _listening_ports() -> set[int]:
    """The TCP ports this process listens on (the sockets of /proc/self/fd found in /proc/net/tcp{,6})."""
    try:
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed meanwhile (the listing's own)
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        ports = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            if not os.path.exists(table):
                continue
            with open(table) as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                        ports.add(int(cols[1].rsplit(":", 1)[1], 16))
        return ports
    except OSError:
        return set()


def lost_node_line(lost: LostNode, *, endpoint: str, resume: str) -> str:
    """The line a surviving launcher prints."""
    what = f"lost node {lost.host} (launcher pid {lost.pid})"
    if lost.hosted_store:
        what += f", which hosted the rendezvous at {endpoint}"
    return f"error: {what}: it stopped answering for {LOST_AFTER_S:.0f} s, so this node's ranks were stopped; {resume}"


def resume_hint(module: str | None, trainer_args: list[str]) -> str:
    """Where the same command resumes from, found from the trainer's config (``torchtitan.train`` only)."""
    if module != "torchtitan.train":
        return "restart the same command on every node"
    try:
        from torchtitan.checkpointing.files.folders import resume_point
        from torchtitan.config.manager import JobConfig
        from torchtitan.launch.run_folder import checkpoint_root

        config = JobConfig.parse_args(trainer_args)
        ckpt = config.checkpoint
        found = resume_point(checkpoint_root(config), enabled=ckpt.enable_checkpoint, load_step=ckpt.load_step)
    except Exception:  # noqa: BLE001 - the ranks parsed it; here it only adds a hint
        return "restart the same command on every node"
    if not ckpt.enable_checkpoint:
        return "checkpointing is off (checkpoint.enable_checkpoint): the same command starts again from step 0"
    if found is None:
        return f"no complete checkpoint in {checkpoint_root(config)}: the same command starts again from step 0"
    return f"the same command on every node resumes from checkpoint step-{found.step} ({found.path})"
