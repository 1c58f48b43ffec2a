"""``checkpoint.async_mode = "async_with_pinned_mem"``: the step waits only for a copy of the state into host
staging buffers; DCP writes it to disk in the background.

torch's ``DefaultStager`` (torch/distributed/checkpoint/staging.py) copies every tensor of the saved state into host
buffers from a background thread, and DCP's upload thread starts writing once that copy is done. The buffers are
cached by the source tensor's storage, so one stager kept for the manager's life allocates them once and every later
save copies into the same ones: the mode holds an extra host copy of the saved state for the whole run. With an
accelerator the buffers are pinned and the copies non-blocking on a staging stream (device-to-host at full bus speed,
overlapped with the next step's compute). Without one, pinning buys nothing: the buffers are plain host memory and
the copy is a memcpy on the staging thread, overlapped with the next step's forward and backward all the same.

The copy reads the live parameters and optimizer state while training goes on, so nothing may change them before
it is done: the manager waits for it in a pre-hook of the optimizer's step. What changes weights outside that step
refuses this mode before launch, in its own check: the optimizer step in backward, synchronous fault tolerance's
heal. The MoE expert bias, pure bf16's update and LocalSGD/DiLoCo's weight changes come at or after that step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

logger = logging.getLogger(__name__)


def pins_memory(device: torch.device) -> bool:
    """Whether staging from ``device`` uses pinned buffers and non-blocking copies: only from an accelerator."""
    return device.type != "cpu" and torch.accelerator.is_available()


def build_async_stager(device: torch.device) -> DefaultStager:
    """The stager of a run on ``device``: staging in a background thread into cached host buffers, pinned (with
    non-blocking copies) only where ``pins_memory``. Thread-based uploads: no shared memory."""
    pinned = pins_memory(device)
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=pinned
        )
    )


class BackgroundStaging:
    """One stager for the manager's life (``copier``: every save reuses its host buffers) and ``wait_staging`` before
    every update of ``optimizer`` (the copy reads the live tensors), from the optimizer's step pre-hook. ``log``: say
    once what the buffers are where they cannot be pinned (rank 0)."""

    def __init__(
        self, device: torch.device, optimizer: torch.optim.Optimizer, wait_staging: Callable[[], None], *, log: bool
    ):
        self.device, self.pinned = device, pins_memory(device)
        self.copier = build_async_stager(device)
        self._hook = optimizer.register_step_pre_hook(lambda *_: wait_staging())
        if log and not self.pinned:
            logger.info(
                "checkpoint.async_mode = 'async_with_pinned_mem' on %s: pinned memory needs an accelerator; here the "
                "staging buffers are plain host memory, filled by a background thread while training goes on",
                device.type,
            )

    def copier_for_save(self) -> DefaultStager:
        """The stager, once the device has run what is queued: its copies run on a stream of their own, which does not
        wait for the compute stream (where the saved step's optimizer update may still be running)."""
        if self.pinned:
            torch.accelerator.synchronize(self.device)
        return self.copier

    def close(self) -> None:
        self._hook.remove()
        self.copier.close()  # its staging thread and cached buffers


class _NoBackgroundStaging:
    """The other async modes' (and a sync run's): DCP's writer copies the state before ``async_save`` returns."""

    def copier_for_save(self) -> None:
        return None

    def close(self) -> None:
        pass


NO_STAGING = _NoBackgroundStaging()


def log_blocked(step: int, seconds: float) -> None:
    logger.info("checkpoint step-%d: blocked the step %.2f s (staging), written in the background", step, seconds)


@dataclass
class InFlightSave:
    """The manager's record of its async save in flight."""

    written: Future
    """DCP's upload: done once every rank's files and ``.metadata`` are written."""
    step: int
    kind: str
    start: float
    """``time.perf_counter()`` when the DCP save began (the "complete in X s" line)."""
    copied: Future | None = None
    """The background staging copy until the training thread has waited for it (None: waited, or copied before
    ``dcp.async_save`` returned, as ``async_mode = "async"`` does)."""

    def wait_copy(self) -> float | None:
        """Block until the background copy is done; the seconds waited, or None where there was none to wait for or
        it failed (``written`` raises its error)."""
        if self.copied is None:
            return None
        start = time.perf_counter()
        futures.wait([self.copied])
        failed, self.copied = self.copied.exception() is not None, None
        return None if failed else time.perf_counter() - start
