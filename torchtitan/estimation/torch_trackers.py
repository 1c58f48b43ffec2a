"""torch's memory trackers as the estimate runs them: over several FSDP roots, with frozen parameters, and around
compiled blocks. What they track and how the step runs under them is tracker.py."""

from __future__ import annotations

from torch.distributed._tools import FSDPMemTracker, MemTracker
from torch.distributed.fsdp import FSDPModule


class _FSDPRootsMemTracker(FSDPMemTracker):
    """``FSDPMemTracker`` over the model and the FSDP modules the step runs besides it (RL's frozen reference), each
    root's FSDP states instrumented alike (torch's tracker instruments its one root only)."""

    def __init__(self, roots: list, optimizer):
        super().__init__(mod=roots[0], optm=optimizer)
        self._roots = roots

    def _instrument_fsdp_module(self) -> None:
        model = self._root_mod
        try:
            for root in self._roots:
                self._root_mod = root
                super()._instrument_fsdp_module()
        finally:
            self._root_mod = model


class _CompiledRootsMemTracker(_FSDPRootsMemTracker):
    """Runs compiled code: see ``_CompiledMemTracker``."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class _CompiledMemTracker(MemTracker):
    """``MemTracker`` under which compiled blocks run compiled.

    Dynamo declines to compile while a dispatch mode that wants every op is active: the blocks would run eagerly
    (with no partitioner, the memory of mode 'none'). A mode that ignores the compile's internals is off while
    dynamo and AOTAutograd trace, and on while the compiled graphs run, whose ops it then sees one by one (the
    estimator runs them op by op: estimation/fake_trainer.py, ``compile_patches``).
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def build_tracker(trainer, step_modules: list) -> MemTracker:
    """FSDP's tracker over the trainer's one FSDP model part and the step's FSDP modules, else the plain one over every
    module; with ``training.compile``, one under which compiled blocks run compiled."""
    model_parts, optimizer = trainer.model_parts, trainer.optimizer
    compiled = trainer.core.config.training.compile
    modules = [*model_parts, *step_modules]
    if len(model_parts) == 1 and all(isinstance(m, FSDPModule) for m in modules):
        roots = _CompiledRootsMemTracker if compiled else _FSDPRootsMemTracker
        return _skip_frozen(roots(modules, optimizer), modules)
    tracker = _skip_frozen(_CompiledMemTracker() if compiled else MemTracker(), modules)
    tracker.track_external(*modules, optimizer)
    return tracker


class _NoHook:
    def remove(self) -> None:
        pass


def _skip_frozen(tracker, model_parts):
    """torch's trackers hook every parameter's gradient and refuse a frozen one (LoRA's base: no gradient to
    count); its hook entry is filled with no-ops, so the parameter itself is still counted."""
    for part in model_parts:
        for p in part.parameters():
            if not p.requires_grad:
                tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    return tracker
