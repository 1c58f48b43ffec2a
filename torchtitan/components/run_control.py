"""What may end a run early, agreed by every rank once per step: a non-finite step, a stop signal.

``StepGuard.check`` runs after the gradients are clipped and before the optimizer steps: one
all-reduce (MAX) over the whole world of two flags, "this step's loss or grad norm is not finite"
and "a stop was asked for", so every rank takes the same branch. It costs one host sync per step.

``StopSignals`` turns SIGTERM / SIGINT (what a cluster's preemption and Ctrl-C send) into a flag
the guard reads: the step in flight finishes, the trainer saves and exits with ``EXIT_STOPPED``.
A second signal, more than ``ECHO_SECONDS`` after the first, exits at once; signals closer together
are one request (Ctrl-C reaches every process of the terminal's group, and torchrun then forwards
the same signal to its workers).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Protocol

import torch
import torch.distributed as dist

from torchtitan.distributed.backend.device import synchronize

logger = logging.getLogger(__name__)

# Exit codes besides 0 (done), 1 (a bug: traceback) and 2 (a user error: one line).
EXIT_STOPPED = 3  # stopped by SIGTERM/SIGINT after finishing the step (and saving it)
EXIT_NONFINITE = 4  # stopped on a non-finite loss or grad norm; no checkpoint holds that step
# (5: fault tolerance gave up, fault_tolerance/errors.py)

ECHO_SECONDS = 2.0


class AgreedStop(Exception):
    """An end of the run every rank agreed on (a stop signal, a non-finite step, a feature's verdict): told in one
    line by the entry point, exiting with the subclass's ``exit_code``."""

    exit_code = 1


class RunStopped(AgreedStop):
    """Raised after a requested stop has been carried out (the step finished, the checkpoint saved)."""

    exit_code = EXIT_STOPPED


class NonFiniteStep(AgreedStop):
    """Raised (on every rank) when the non-finite policy says stop."""

    exit_code = EXIT_NONFINITE


@dataclass(frozen=True)
class Verdict:
    skip: bool  # the step's numbers are not finite and the policy skips it: no optimizer step
    stop: bool  # a stop was asked for on some rank: finish this step, save, exit


class Guard(Protocol):
    """The per-step agreement every rank reaches on the step's numbers and the stop signals (``StepGuard``)."""

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> Verdict: ...


class StepGuard:
    """One agreement per step across every rank; applies ``training.on_nonfinite``.

    Args:
        policy: "stop" raises ``NonFiniteStep`` naming the step; "skip" drops the step's update
            and raises once ``max_skips`` steps in a row were skipped.
        signals: where stop requests come from (None: never).
        on_wait: told the seconds this rank waited in the all-reduce for the others, the device synchronized
            before it (the straggler watch, features/stragglers/stragglers.py; None: no extra sync).
    """

    def __init__(
        self,
        policy: str,
        max_skips: int,
        device: torch.device,
        signals: StopSignals | None = None,
        on_wait: Callable[[float], None] | None = None,
    ):
        if policy not in ("stop", "skip"):
            raise ValueError(f"training.on_nonfinite = {policy!r}: allowed are 'stop', 'skip'")
        self.policy, self.max_skips, self.device, self.signals = policy, max_skips, device, signals
        self.on_wait = on_wait
        self.skipped_in_a_row = 0
        self.skipped_total = 0

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> Verdict:
        """``loss``: this rank's share of the step's loss; ``grad_norm``: the global norm (or a local share)."""
        bad = ~(torch.isfinite(loss.detach().float()).all() & torch.isfinite(grad_norm.detach().float()).all())
        stop_asked = self.signals is not None and self.signals.requested is not None
        flags = torch.stack([bad.float(), torch.tensor(float(stop_asked), device=bad.device)]).to(self.device)
        start = 0.0
        if self.on_wait is not None:  # the straggler watch: time only the wait for the others, not own queued work
            synchronize(self.device)
            start = time.perf_counter()
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        nonfinite, stop = (bool(v) for v in flags.tolist())
        if self.on_wait is not None:
            self.on_wait(time.perf_counter() - start)
        if not nonfinite:
            self.skipped_in_a_row = 0
            return Verdict(skip=False, stop=stop)
        what = f"step {step}: the loss or gradient norm is not finite (loss {_fmt(loss)}, grad norm {_fmt(grad_norm)})"
        if self.policy == "stop":
            raise NonFiniteStep(
                f"{what}; stopped before the optimizer step, so no checkpoint holds it. Lower optimizer.lr, "
                "raise training.warmup_steps or set training.max_norm, then resume from the last good "
                "checkpoint; training.on_nonfinite = 'skip' drops such steps instead"
            )
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        if self.skipped_in_a_row >= self.max_skips:
            raise NonFiniteStep(
                f"{what}; {self.skipped_in_a_row} steps in a row were skipped "
                f"(training.max_nonfinite_skips = {self.max_skips}); resume from the last good checkpoint "
                "with a lower optimizer.lr"
            )
        logger.warning(
            "%s; skipping its update (%d in a row, training.on_nonfinite = 'skip')", what, self.skipped_in_a_row
        )
        return Verdict(skip=True, stop=stop)


def _fmt(t: torch.Tensor) -> str:
    value = float(t.detach().float().sum()) if t.numel() else math.nan
    return f"{value:.4g}"


class StopSignals:
    """SIGTERM/SIGINT set ``requested``; a second signal (not an echo of the first) exits at once.

    Install in the main thread only (Python delivers signals there); ``restore`` puts the previous
    handlers back.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, clock=time.monotonic):
        self.requested: signal.Signals | None = None
        self.first_at = 0.0
        self.clock = clock
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> StopSignals:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        now = self.clock()
        if self.requested is None:
            self.requested, self.first_at = sig, now
            logger.warning(
                "received %s: finishing the step in flight, then saving a checkpoint and stopping "
                "(send it again to stop at once)",
                sig.name,
            )
        elif now - self.first_at > ECHO_SECONDS:
            logger.warning("received %s again: stopping at once, without saving", sig.name)
            os._exit(128 + signum)
