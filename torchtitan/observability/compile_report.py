"""What ``training.compile`` did in a run, said once (the registry's ``after_step`` slot): after the first step, its
seconds (compilation's cold start), the graphs dynamo made and each graph break's reason; at the last step, the
graphs made after the first step (recompiles), and a run that recompiled at every step says so."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan.components.parts import CoreParts
    from torchtitan.components.seams import Metrics

logger = logging.getLogger(__name__)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {reason.split("\n")[0].strip(): n for reason, n in counters["graph_break"].items()}


def describe_first_step(seconds: float, graphs: int, breaks: dict[str, int]) -> str:
    """The line after the first step: its seconds, the graphs, the graph breaks by reason (none: 'no graph break')."""
    told = "; ".join(f"{n} x {reason}" for reason, n in sorted(breaks.items())) or "no graph break"
    return f"compile: first step {seconds:.1f} s (compilation included), {graphs} graphs; {told}"


def describe_end(steps: int, recompiled: int) -> str:
    """The line at the last step: the graphs made after the first of ``steps`` steps."""
    if steps > 2 and recompiled >= steps - 1:
        return (
            f"compile: {recompiled} recompiles in the {steps - 1} steps after the first: the run recompiled at every "
            "step (each step paid compilation; see TORCH_LOGS=recompiles for the guard that failed)"
        )
    return f"compile: {recompiled} recompiles in the {steps - 1} steps after the first"


class CompileReport:
    """Logs ``describe_first_step`` at the run's first step and ``describe_end`` at ``last_step`` (rank 0)."""

    def __init__(self, *, last_step: int, log: bool):
        self.last_step, self.log = last_step, log
        self.started = time.perf_counter()  # the build is done: the first step's time starts here
        self.first_step: int | None = None
        self.graphs_after_first = 0

    def maybe_run(self, step: int) -> None:
        if self.first_step is None:
            self.first_step, self.graphs_after_first = step, _graphs()
            if self.log:
                seconds = time.perf_counter() - self.started
                logger.info(describe_first_step(seconds, self.graphs_after_first, _breaks()))
        if step == self.last_step and step > self.first_step and self.log:
            logger.info(describe_end(step - self.first_step + 1, _graphs() - self.graphs_after_first))


def build_compile_report(core: CoreParts, metrics: Metrics) -> CompileReport:
    """The ``after_step`` work with ``training.compile``."""
    return CompileReport(last_step=core.config.training.steps, log=core.rank == 0)
