"""Step replay: a check against silent data corruption (a device that computes a wrong number without failing).

Every ``training.replay_every_n_steps`` steps each rank trains the step twice: the forward and backward of
every micro-batch, then again from the same inputs, weights and RNG state (the gradients set to None in
between, the family's per-pass statistics forgotten). Under ``training.deterministic`` both passes must give
the same bits; each rank compares its loss and a checksum of every local gradient (the sum of the tensor's
bit patterns as integers: exact, so any single flipped bit changes it) between the passes. A mismatch on any
rank (one all-reduce of a flag, then the ranks' findings gathered) is one line naming the rank, its host, the
step and the first tensor that differs; ``training.on_replay_mismatch = "stop"`` raises ``ReplayMismatch`` on
every rank before the optimizer step (exit code 6; no checkpoint holds the step, the last one is kept),
"warn" logs the line on every rank and the step goes on with the replay's gradients.

The replay changes nothing else: the optimizer state, the data order (the same batches, no new read), the LR
schedule and the RNG (restored, so it ends where the first pass left it) are untouched, so a clean run with
replay on has the same losses bit for bit. Cost: one more forward + backward of the whole step every N
steps (about 1/N more compute), the gradients' checksums (one integer sum per tensor) and one small
all-reduce on those steps. Refused before launch: pipeline parallel (the schedule runs its own passes),
``optimizer.early_step_in_backward`` (the weights change during the first backward), fault tolerance, and
without ``training.deterministic`` (non-deterministic kernels would differ between passes: false alarms).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.components.run_control import AgreedStop

if TYPE_CHECKING:
    from torchtitan.components.parts import CoreParts
    from torchtitan.spec import StepHooks

logger = logging.getLogger(__name__)

# A test's fault injection (a seam, not an env var): called after each pass's backward with
# (step, pass number 1 or 2, this rank's named parameters), before the checksums are taken.
AfterPass = Callable[[int, int, Sequence[tuple[str, nn.Parameter]]], None]

EXIT_REPLAY_MISMATCH = 6  # a replayed step computed other numbers; no checkpoint holds it (run_control.py has 3-4)


class ReplayMismatch(AgreedStop):
    """Raised (on every rank) when a replayed step differs and ``training.on_replay_mismatch`` says stop."""

    exit_code = EXIT_REPLAY_MISMATCH


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_checksum(t: torch.Tensor) -> torch.Tensor:
    """The sum of the tensor's bit patterns read as integers (int64): equal bits give equal sums, and one
    flipped bit changes it (by +-2^k). ``t``: a plain (local) tensor."""
    bits = t.detach().contiguous().reshape(-1).view(_INT_OF_WIDTH[t.element_size()])
    return bits.sum(dtype=torch.int64)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor gradient: this rank's shard


class StepReplay:
    """Trains chosen steps twice and compares the passes bit for bit (see the module docstring)."""

    def __init__(
        self,
        *,
        every_n_steps: int,
        on_mismatch: str,
        model_parts: Sequence[nn.Module],
        device: torch.device,
        rank: int,
        hooks: StepHooks | None = None,
        after_pass: AfterPass | None = None,
    ):
        if on_mismatch not in ("stop", "warn"):
            raise ValueError(f"training.on_replay_mismatch = {on_mismatch!r}: allowed are 'stop', 'warn'")
        self.every_n_steps, self.on_mismatch = every_n_steps, on_mismatch
        self.params = [(name, p) for part in model_parts for name, p in part.named_parameters()]
        self.device, self.rank, self.hooks, self.after_pass = device, rank, hooks, after_pass
        self.host = socket.gethostname()
        self.replayed = 0  # steps replayed so far (for the end of a run, tests)

    def due(self, step: int) -> bool:
        return self.every_n_steps > 0 and step % self.every_n_steps == 0

    def run(self, step: int, train_pass: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
        """``train_pass(*args, **kwargs)`` (the step's forward and backward, returning this rank's loss), twice on a
        replay step."""
        if not self.due(step):
            return train_pass(*args, **kwargs)
        rng = _rng_state(self.device)
        first_loss = train_pass(*args, **kwargs)
        first = self._checksums(step, 1)
        for _, p in self.params:
            p.grad = None
        if self.hooks is not None:
            self.hooks.discard_step()  # per-pass statistics (MoE token counts): the replay counts them again
        _set_rng_state(self.device, rng)
        loss = train_pass(*args, **kwargs)
        found = self._compare(first_loss, first, loss, self._checksums(step, 2))
        self._agree(step, found)
        self.replayed += 1
        return loss

    def _checksums(self, step: int, pass_number: int) -> torch.Tensor:
        if self.after_pass is not None:
            self.after_pass(step, pass_number, self.params)
        sums = [bit_checksum(_local(p.grad)) if p.grad is not None else None for _, p in self.params]
        none = torch.tensor(-1, dtype=torch.int64, device=self.device)  # no gradient (a frozen parameter)
        return torch.stack([s if s is not None else none for s in sums]) if sums else none.reshape(1)

    def _compare(self, loss1: torch.Tensor, sums1: torch.Tensor, loss2: torch.Tensor, sums2: torch.Tensor) -> str:
        """What differs on this rank ("" if nothing), as part of the one line."""
        differ = (sums1 != sums2).nonzero().flatten().tolist()
        parts = []
        if not torch.equal(bit_checksum(loss1.float()), bit_checksum(loss2.float())):
            parts.append(f"loss {loss1.item():.9g} vs {loss2.item():.9g}")
        if differ:
            name, more = self.params[differ[0]][0], len(differ) - 1
            s1, s2 = sums1[differ[0]].item(), sums2[differ[0]].item()
            also = f"; {more} more tensor{'s' if more > 1 else ''} differ" if more else ""
            parts.append(f"gradient of {name} (checksum {s1} vs {s2}{also})")
        return f"rank {self.rank} (host {self.host}): {', '.join(parts)}" if parts else ""

    def _agree(self, step: int, found: str) -> None:
        """Every rank learns every rank's finding (one all-reduce; a gather only on a mismatch) and acts alike."""
        flag = torch.tensor([1.0 if found else 0.0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            logger.info("step replay: step %d replayed on every rank, the same loss and gradients bit for bit", step)
            return
        findings = [found]
        if dist.is_initialized():
            findings = [None] * dist.get_world_size()
            dist.all_gather_object(findings, found)
        what = "; ".join(f for f in findings if f)
        line = (
            f"step replay: step {step} computed other numbers when replayed from the same inputs and weights "
            f"(deterministic): {what}: silent data corruption on that device is likely"
        )
        if self.on_mismatch == "warn":
            logger.warning("%s; training.on_replay_mismatch = 'warn': going on with the replay's gradients", line)
            return
        raise ReplayMismatch(
            f"{line}; stopped before the optimizer step (exit code {EXIT_REPLAY_MISMATCH}), so no checkpoint holds "
            "it: resume from the last checkpoint without that host (training.on_replay_mismatch = 'warn' only logs)"
        )


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    return torch.get_rng_state(), module.get_rng_state(device) if module is not None else None


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        getattr(torch, device.type).set_rng_state(state[1], device)


def build_step_replay(core: CoreParts, *, after_pass: AfterPass | None = None) -> StepReplay:
    """The ``step_pass`` seam with ``training.replay_every_n_steps`` (features/registry.py); ``after_pass``: a
    test's fault injection."""
    t = core.config.training
    return StepReplay(
        every_n_steps=t.replay_every_n_steps,
        on_mismatch=t.on_replay_mismatch,
        model_parts=core.model_parts,
        device=core.device,
        rank=core.rank,
        hooks=core.step_fn.hooks,
        after_pass=after_pass,
    )
