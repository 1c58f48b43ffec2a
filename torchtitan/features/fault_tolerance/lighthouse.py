"""torchft's lighthouse: where a replica group finds it, and starting one (tests, the local demo).

The lighthouse is a small Rust server shipped in the torchft wheel (console script ``torchft_lighthouse``); it
forms the quorum of live replica groups each step. Replica groups find it through ``TORCHFT_LIGHTHOUSE``
(``http://HOST:PORT``), as in torchft and upstream torchtitan.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from torchtitan.features.fault_tolerance.errors import ReplicaGroupsFailed, require_torchft

logger = logging.getLogger(__name__)

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"

# The lighthouse logs "Lighthouse listening on: http://HOST:PORT"; HOST is the machine's name, not the bind
# address, so only the port is read and the address is rebuilt from the bind host.
_LISTENING = re.compile(r"Lighthouse listening on: \S+:(\d+)")


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
    require_torchft()
    # The console script, beside this interpreter first so it is this interpreter's torchft. Its Rust main
    # parses the process's own argv, so `python -c "...lighthouse_main()"` cannot stand in for it.
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    script = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if script is None:
        raise RuntimeError("torchft is installed but its console script torchft_lighthouse is not on PATH")
    args = [f"--min_replicas={min_replicas}", f"--bind={host}:{port}", f"--join_timeout_ms={join_timeout_ms}"]
    args += [f"--heartbeat_timeout_ms={heartbeat_timeout_ms}", f"--quorum_tick_ms={quorum_tick_ms}"]
    # its "listening on" line is at INFO, which the trainer's quieting of torchft (RUST_LOG=warn) would hide
    env = {**os.environ, "RUST_LOG": "info"}
    process = subprocess.Popen([script, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
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


def lighthouse_address() -> str:
    """``TORCHFT_LIGHTHOUSE``: the pre-launch check refuses a fault-tolerant run without it."""
    return os.environ[LIGHTHOUSE_ENV]


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of an ``http://HOST:PORT`` address; ValueError naming the variable if it is not one."""
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(
            f"{LIGHTHOUSE_ENV} = {address!r}: expected the lighthouse's address as http://HOST:PORT, e.g. "
            "http://localhost:29510 (what torchft_lighthouse --bind [::]:29510 listens on)"
        )
    return parts.hostname, port


def reachable(address: str, timeout_s: float = 2.0) -> str | None:
    """None if a TCP connection to the lighthouse opens, else why not (one line)."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def wait_for_lighthouse(address: str, timeout_s: float) -> None:
    """Return once the lighthouse accepts connections (it may be starting beside this launch).

    Raises:
        ReplicaGroupsFailed: it did not within ``timeout_s``, naming the address and the reason.
    """
    deadline = time.monotonic() + timeout_s
    while (why := reachable(address)) is not None:
        if time.monotonic() > deadline:
            raise ReplicaGroupsFailed(
                f"fault tolerance: the lighthouse at {address} ({LIGHTHOUSE_ENV}) is unreachable: {why} (waited "
                f"{timeout_s:.0f} s, fault_tolerance.quorum_timeout_seconds); start it first (torchft_lighthouse "
                "--min_replicas 1 --bind [::]:29510) or fix the address"
            )
        time.sleep(0.2)
