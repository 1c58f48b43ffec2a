"""training.compile's report (torchtitan/observability/compile_report.py): the first step's line and the recompiles at
the end, read from dynamo's own counters."""

from __future__ import annotations

import logging

import torch

from torchtitan.observability.compile_report import CompileReport, describe_end, describe_first_step


def test_the_lines_say_what_happened():
    assert (
        describe_first_step(12.34, 3, {})
        == "compile: first step 12.3 s (compilation included), 3 graphs; no graph break"
    )
    line = describe_first_step(1.0, 7, {"Skip calling `torch.compiler.disable()`d function": 2})
    assert line.endswith("7 graphs; 2 x Skip calling `torch.compiler.disable()`d function")
    assert describe_end(10, 0) == "compile: 0 recompiles in the 9 steps after the first"
    assert "recompiled at every step" in describe_end(4, 3)
    assert "every step" not in describe_end(4, 2)


def test_a_compiled_function_whose_shape_changes_every_step_is_told(caplog):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # a recompile for every new shape, as a step whose inputs change would (marked static: no dynamic shapes)
    step = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)
    report = CompileReport(last_step=4, log=True)
    with caplog.at_level(logging.INFO, logger="torchtitan.observability.compile_report"):
        for s in range(1, 5):
            step(torch.ones(s))
            report.maybe_run(s)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("compile: first step") and "1 graphs; no graph break" in lines[0], lines
    assert lines[1].startswith("compile: 3 recompiles in the 3 steps after the first: the run recompiled at every step")
    torch._dynamo.reset()
