"""Run the trainer's own step twice under torch's memory trackers and read the peak breakdown.

The same code runs on fake tensors (the estimate) and on real ones (``memory_estimation.
disable_fake_mode``, used by the accuracy tests), so the two are directly comparable.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.distributed._tools import FSDPMemTracker
from torch.nn.modules.module import register_module_forward_pre_hook

from torchtitan.components.batch import Batch
from torchtitan.estimation.torch_trackers import build_tracker

# Tracker category -> report row. FSDPMemTracker and MemTracker name the same things differently.
CATEGORIES = {
    "Sharded Param": "params (sharded)",
    "Parameter": "params",
    "Unsharded Param": "params (unsharded)",
    "Buffer": "buffers",
    "Sharded Grad": "grads (sharded)",
    "Gradient": "grads",
    "Unsharded Grad": "grads (unsharded)",
    "OptState": "optimizer state",
    "Optstate": "optimizer state",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "comm: all-gather",
    "Reduce Scatter": "comm: reduce-scatter",
    "Inputs": "inputs",
    "Other": "other",
}
DDP_BUCKETS = "comm: DDP buckets"
# the tracker's rows; a feature's modeled rows (fault tolerance's semi-synchronous copies) follow, as added
ROWS = [*dict.fromkeys(CATEGORIES.values()), DDP_BUCKETS]


@dataclass
class Phase:
    """Bytes live at a peak, in total and by report row."""

    total: int
    breakdown: dict[str, int]

    def extrapolate(self, other: Phase, t: float) -> Phase:
        """The affine combination self + t * (other - self), per row (for depth extrapolation)."""
        rows = dict.fromkeys([*self.breakdown, *other.breakdown])
        breakdown = {
            r: round(self.breakdown.get(r, 0) + t * (other.breakdown.get(r, 0) - self.breakdown.get(r, 0)))
            for r in rows
        }
        return Phase(round(self.total + t * (other.total - self.total)), {r: v for r, v in breakdown.items() if v})


@dataclass
class StepMemory:
    """Peak bytes of one rank over a training step and what they hold at that moment.

    ``tracked``: the trackers' peak over the tracked steps (forward, backward, and the optimizer
    step as it ran). ``optimizer_step``: on fake runs with a foreach optimizer, the modeled peak of
    the foreach step (live memory at the step plus its list-wide temporaries, see
    ``use_per_parameter_step``); None otherwise. The reported peak is the larger of the two.
    """

    tracked: Phase
    optimizer_step: Phase | None = None
    notes: list[str] = field(default_factory=list)
    # Memory added by a model instead of being tracked on the fake run (by report row).
    modeled: dict[str, int] = field(default_factory=dict)
    # The tracked peak of the last step up to the moment the backward of the third-to-last
    # transformer block is done: the moments where (nearly) every block's activations are live.
    # Only the depth extrapolation reads it.
    all_activations: Phase | None = None
    # What is live when the optimizer step starts (the gradients complete), and fault tolerance's
    # semi-synchronous modes' synchronization after it (fault_tolerance/estimate.py): that plus their copies.
    at_optimizer_step: Phase | None = None
    synchronization: Phase | None = None
    # The peak of each phase a step names (its runner's ``phase_done`` calls: the RL step's generation) in the last step.
    phases: dict[str, Phase] = field(default_factory=dict)

    @property
    def _phases(self) -> list[Phase]:
        candidates = (self.tracked, self.all_activations, self.optimizer_step, self.synchronization)
        return [p for p in candidates if p is not None] + list(self.phases.values())

    @property
    def _top(self) -> Phase:
        return max(self._phases, key=lambda p: p.total)

    @property
    def peak(self) -> int:
        return self._top.total

    @property
    def breakdown(self) -> dict[str, int]:
        return self._top.breakdown

    @property
    def peak_phase(self) -> str:
        for name, phase in self.phases.items():  # a named phase that reaches the tracked peak holds it
            if phase.total >= self._top.total:
                return name
        if self._top is self.synchronization:
            return "replica synchronization"
        return "optimizer step" if self._top is self.optimizer_step else "forward/backward"

    def add_synchronization(self, row: str, nbytes: int, note: str) -> None:
        """Modeled memory held right after the optimizer step (a semi-sync synchronization), on top of what is
        live when the step starts."""
        assert self.at_optimizer_step is not None, "track_steps records what is live at the optimizer step"
        start = self.at_optimizer_step
        self.synchronization = Phase(start.total + nbytes, {**start.breakdown, row: nbytes})
        self.modeled[row] = self.modeled.get(row, 0) + nbytes
        self.notes.append(note)

    def add_persistent(self, row: str, nbytes: int, note: str) -> None:
        """Modeled memory, live throughout the step, of something the fake run cannot execute (DDP's reducer)."""
        for phase in (*self._phases, self.at_optimizer_step):
            if phase is not None:
                phase.total += nbytes
                phase.breakdown[row] = phase.breakdown.get(row, 0) + nbytes
        self.modeled[row] = self.modeled.get(row, 0) + nbytes
        self.notes.append(note)

    def extrapolate(self, other: StepMemory, t: float, note: str) -> StepMemory:
        """Self at depth d1, other at d2, result at d1 + t * (d2 - d1).

        Memory at any one moment of the step is affine in depth, but the peak is a maximum over
        moments, and the moment can change with depth: a shallow model may peak at the end of
        backward (embedding and output gradients), a deep one where every block's activations are
        live. Each candidate is extrapolated on its own (the overall tracked peak, the peak up to
        the first blocks' backward, the optimizer step) and the largest wins. The all-activations
        moment grows fastest with depth, so once it wins it keeps winning; a switch between the
        two reduced depths only makes the overall-peak line lower than it.
        """

        def both(a: Phase | None, b: Phase | None) -> Phase | None:
            return a.extrapolate(b, t) if a is not None and b is not None else None

        modeled = {r: round(v + t * (other.modeled.get(r, 0) - v)) for r, v in self.modeled.items()}
        notes = [n for n in self.notes if not n.startswith("foreach")] + [note]
        return StepMemory(
            self.tracked.extrapolate(other.tracked, t),
            both(self.optimizer_step, other.optimizer_step),
            notes,
            modeled,
            both(self.all_activations, other.all_activations),
            both(self.at_optimizer_step, other.at_optimizer_step),
            both(self.synchronization, other.synchronization),
            {n: p.extrapolate(other.phases[n], t) for n, p in self.phases.items() if n in other.phases},
        )


def _breakdown(snapshot: dict) -> dict[str, int]:
    out = dict.fromkeys(ROWS, 0)
    for device_stats in snapshot.values():
        for name, nbytes in device_stats.items():
            if name != "Total":
                out[CATEGORIES.get(name, "other")] += nbytes
    return {k: v for k, v in out.items() if v}


def _total(snapshot: dict) -> int:
    return sum(stats.get("Total", 0) for stats in snapshot.values())


def _label_in_backward_states(tracker, trainer) -> list:
    """With the optimizer step in backward, the state is created by one-parameter optimizers FSDP's
    tracker does not watch (torch's plain MemTracker watches every optimizer): label it as optimizer
    state right after each of their steps, not as temporaries."""
    if not trainer.core.optimizer_step.steps_in_backward or not isinstance(tracker, FSDPMemTracker):
        return []
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    def label(optimizer, *_):
        tracker._track_optimizer_states(_FSDPRefType.OPT, optimizer)

    stepping = trainer.core.optimizer_step.stepping(trainer.optimizer)
    return [one.register_step_post_hook(label) for one in stepping]


@contextmanager
def _one_tracked_forward_per_call(tracker, roots) -> Iterator[None]:
    """Let a step call each root module several times (micro-batches of gradient accumulation or
    of a pipeline schedule).

    torch's trackers refuse a second top-level forward of a module within one tracked iteration.
    The root's own statistics entry is dropped before each such call (its submodules' entries,
    which pending backward hooks of earlier micro-batches still read, stay); the tracker-wide
    peak and its breakdown, which are what the estimate reads, are kept. Registered before the
    tracker's own global hooks, so it runs first; recomputation inside backward (activation
    checkpointing) is the tracker's own case and is left alone.
    """
    ids = {id(m) for m in roots}

    def reset(module, args):
        if torch.compiler.is_compiling():
            # a module inside a compiled block (never a root): tracing this hook's test would guard each compiled
            # block on its submodules' identity, one recompile per block
            return
        if id(module) in ids and module in tracker.memory_tracking and torch._C._current_graph_task_id() == -1:
            del tracker.memory_tracking[module]

    handle = register_module_forward_pre_hook(reset)
    try:
        with _non_leaf_stage_inputs():
            yield
    finally:
        handle.remove()


@contextmanager
def _non_leaf_stage_inputs() -> Iterator[None]:
    """Pipeline stages get their inputs as fresh leaves and backpropagate with ``autograd.grad``;
    the trackers' module hooks put a multi-grad hook on every module input, which autograd cannot
    evaluate for a leaf inside ``autograd.grad``. The stage module therefore sees a view of each
    leaf input (no memory, same gradient)."""
    from torch.distributed.pipelining import stage

    def views(args):
        return tuple(a.view_as(a) if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad else a for a in args)

    # metadata inference (first step; torch 2.11 has no _compute_outputs: its _shape_inference runs the stage
    # under no_grad, which needs no views) and every micro-batch's forward
    inference = getattr(stage.PipelineStage, "_compute_outputs", None)
    forward = stage.PipelineStage.forward_maybe_with_nosync
    if inference is not None:
        stage.PipelineStage._compute_outputs = lambda self, *args, module, **kw: inference(
            self, *views(args), module=module, **kw
        )
    stage.PipelineStage.forward_maybe_with_nosync = lambda self, *args, **kw: forward(self, *views(args), **kw)
    try:
        yield
    finally:
        stage.PipelineStage.forward_maybe_with_nosync = forward
        if inference is not None:
            stage.PipelineStage._compute_outputs = inference


def track_steps(trainer, *, foreach_temp: int = 0, steps: int = 2) -> StepMemory:
    """Run the trainer's step (its runner's data and training) ``steps`` times under a tracker; the peak over the steps.

    ``foreach_temp``: bytes of foreach temporaries the tracked step does not allocate (see
    ``use_per_parameter_step``); the optimizer-step peak is then the memory live when the step
    starts plus these, and the reported peak is the larger of that and the tracked peak.
    Compiled blocks (``training.compile``) run compiled under the tracker.
    """
    step_modules = list(trainer.parts.modules.values())
    runner = trainer.parts.runner
    tracker = build_tracker(trainer, step_modules)
    at_opt_step: list[dict] = []
    snap = tracker.get_tracker_snapshot
    hooks = [trainer.optimizer.register_step_pre_hook(lambda *_: at_opt_step.append(snap("current")))]
    phases: dict[str, dict] = {}  # a phase of the step's own (RL's generation): its peak in the last step

    def phase_done(name: str) -> None:
        phases[name] = snap("peak")

    hooks += _label_in_backward_states(tracker, trainer)
    after_last_block: list[dict] = []
    hooks += _all_activations_hooks(tracker, trainer.model_parts, after_last_block)
    earlier: dict = {}
    # As in Trainer.train: no garbage collection during steps. Collection at arbitrary moments
    # frees reference cycles (pipeline works, autograd graphs) at run-dependent points, which made
    # the peak of pipeline schedules differ from run to run by a few percent.
    gc.collect()
    gc.disable()
    try:
        with (
            _one_tracked_forward_per_call(tracker, [*trainer.model_parts, *step_modules]),
            tracker,
            warnings.catch_warnings(),
        ):
            # torch's module tracker runs each forward's end-of-backward callback at the next backward: modules run
            # without autograd and dropped before it (the RL generation's cache kernels) are gone then
            warnings.filterwarnings("ignore", message="Module is None. Skipping POST_BW hook")
            # the trackers' global hooks fire for a compiled block's wrapper too: no tensor of its own, the totals alike
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
            for i in range(steps):
                data = runner.data(trainer.step, iter(trainer.data_loader))
                if isinstance(tracker, FSDPMemTracker):
                    tracker.track_inputs(tuple(t for b in _batches(data) for t in (b.inputs, b.labels)))
                if i == steps - 1:
                    # The all-activations snapshot must read the last step only (see StepMemory):
                    # restart the tracker's running peak, and keep the earlier steps' peak aside.
                    earlier = tracker.get_tracker_snapshot("peak")
                    tracker._peak_mem, tracker._peak_mem_snap = {}, {}
                runner.train(trainer.step, data, phase_done=phase_done)
                if i == 0:
                    tracker.reset_mod_stats()
        peak = max(tracker.get_tracker_snapshot("peak"), earlier, key=_total)
    finally:
        gc.enable()
        for hook in hooks:
            hook.remove()
    memory = _step_memory(peak, at_opt_step[-1] if at_opt_step else None, after_last_block, foreach_temp)
    memory.phases = {name: Phase(_total(p), _breakdown(p)) for name, p in phases.items()}
    return memory


def _all_activations_hooks(tracker, model_parts: list, snapshots: list[dict]) -> list:
    """A backward hook on the third-to-last block of each part (the first few blocks' backward included) that
    appends the tracker's peak to ``snapshots``: the moment every activation is live."""
    hooks = []
    for part in model_parts:
        blocks = [b for b in getattr(part, "layers", {}).values() if b is not None]
        if blocks:
            hooks.append(
                blocks[max(0, len(blocks) - 3)].register_full_backward_hook(
                    lambda *_: snapshots.append(tracker.get_tracker_snapshot("peak"))
                )
            )
    return hooks


def _batches(data: object) -> list[Batch]:
    """The step's micro-batches, where its data is a list of them (pre-training's; RL's step makes its own)."""
    return [b for b in data if isinstance(b, Batch)] if isinstance(data, list) else []


def _step_memory(peak: dict, at_opt_step: dict | None, after_last_block: list[dict], foreach_temp: int) -> StepMemory:
    """The tracked snapshots as a ``StepMemory``: the peak, what is live when the (last) optimizer step starts,
    the all-activations moment, and the modeled foreach step (``track_steps``)."""
    result = StepMemory(Phase(_total(peak), _breakdown(peak)))
    if at_opt_step is not None:
        result.at_optimizer_step = Phase(_total(at_opt_step), _breakdown(at_opt_step))
    if after_last_block:
        last = after_last_block[-1]
        result.all_activations = Phase(_total(last), _breakdown(last))
    if foreach_temp:
        breakdown = _breakdown(at_opt_step)
        breakdown["temporaries"] = breakdown.get("temporaries", 0) + foreach_temp
        result.optimizer_step = Phase(_total(at_opt_step) + foreach_temp, breakdown)
        result.notes.append(
            f"foreach optimizer temporaries modeled: {foreach_temp / 2**20:.1f} MiB on top of "
            f"{_total(at_opt_step) / 2**20:.1f} MiB live at the optimizer step"
        )
    return result
