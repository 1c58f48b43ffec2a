"""Downstream tasks in the training loop (``[eval]``): every ``freq`` steps and at the last step, lm-eval runs the
configured tasks on the live model, in place (no checkpoint round trip, no second copy of the weights), and the
trainer logs each task's metrics (console, metrics.jsonl, TensorBoard) as ``eval/<task>/<metric>``: one line per
evaluation at the run's INFO level (lm-eval's own output shows at ``job.log_level = "debug"``).

Training goes on as if nothing happened: the model returns to train mode, and the RNG states lm-eval seeds
(Python's, numpy's, torch's CPU and device generators) are put back, so the losses after an evaluation equal a
run's without one bit for bit (tests/runs/features/test_eval_runs.py). The data loader, the optimizer and the gradients are
not touched (the forward passes run without grad).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from torchtitan.config.sections.eval import Eval
from torchtitan.observability.logging import third_party_detail

if TYPE_CHECKING:
    from torchtitan.components.parts import CoreParts
    from torchtitan.components.seams import Metrics

logger = logging.getLogger(__name__)


@contextmanager
def kept_rng_state(device: torch.device):
    """Put back every random generator lm-eval or the evaluation may touch."""
    import numpy as np

    py, np_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    dev = torch.get_device_module(device.type).get_rng_state() if device.type not in ("cpu", "meta") else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.get_device_module(device.type).set_rng_state(dev)


def flatten_results(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm-eval's ``results`` -> {"eval/<task>/<metric>": value}: numbers only, no stderr, filter ``,none`` dropped."""
    record = {}
    for task, metrics in sorted(results.items()):
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, flt = key.split(",", 1)
            name = metric if flt == "none" else f"{metric}_{flt}"
            record[f"eval/{task}/{name}"] = float(value)
    return record


@contextmanager
def without_environment_report():
    """lm-eval's ``simple_evaluate`` ends, on rank 0, by adding torch's environment report to its results
    (``torch.utils.collect_env``: ``pip list``, ``lscpu``, the compiler's and driver's versions, each a subprocess;
    1.3 s on a 2-core CPU machine, every evaluation, while the other ranks wait). The trainer keeps only the
    metrics, and the run names its torch, Python, host and commit once (run_info.json): an in-loop evaluation skips
    the report. ``python -m torchtitan.eval`` keeps it in its results file, as lm-eval writes it."""
    import lm_eval.evaluator

    report = lm_eval.evaluator.add_env_info  # an lm-eval without it fails here, by name (pinned: .ci/constraints.txt)
    lm_eval.evaluator.add_env_info = lambda results: None
    try:
        yield
    finally:
        lm_eval.evaluator.add_env_info = report


class InLoopEval:
    """The trainer's ``[eval]``: ``maybe_run(step)`` evaluates at its steps and logs through the trainer's metrics."""

    def __init__(self, core: CoreParts, metrics: Metrics, eval_config: Eval):
        from torchtitan.eval.tasks import build_task_manager

        self.cfg, self.core, self.metrics = eval_config, core, metrics
        self.task_manager = build_task_manager(list(eval_config.tasks), eval_config.include_path)
        from torchtitan.datasets.tokenizer import build_tokenizer

        self.tokenizer = build_tokenizer(core.config.model.tokenizer_path)

    def due(self, step: int) -> bool:
        return step % self.cfg.freq == 0 or step == self.core.config.training.steps

    def maybe_run(self, step: int) -> None:
        if self.due(step):
            self.metrics.log_eval(step, self.run())

    def run(self) -> dict[str, float]:
        """Every task on the live model: the record on rank 0 (lm-eval returns results where LOCAL_RANK is 0), {}
        on the other ranks, which run the same forward passes."""
        import lm_eval

        from torchtitan.eval.lm import TorchtitanLM
        from torchtitan.eval.model import EvalModel

        t = self.core
        (model,) = t.step_fn.model_parts  # pipeline parallel is refused before launch
        feed = t.step_fn.feed  # block_causal training: each request is one document, attended plain causal
        em = EvalModel(model, self.tokenizer, t.world, t.device, t.config.training.seq_len, t.step_fn.amp_dtype)
        if feed is not None:
            em = dataclasses.replace(em, forwards=feed.plain_causal)
        was_training = model.training
        seed = self.cfg.seed
        # lm-eval's notes, `--metadata` hints and progress bars (and datasets' reading the task data) are the run's
        # DEBUG detail: at INFO an evaluation is its one "eval at step" line
        with kept_rng_state(t.device), third_party_detail("lm_eval", "datasets"), without_environment_report():
            model.eval()
            try:
                lm = TorchtitanLM(model=em, batch_size=self.cfg.batch_size, seed=seed)
                out = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=list(self.cfg.tasks),
                    task_manager=self.task_manager,
                    limit=self.cfg.limit,
                    num_fewshot=self.cfg.num_fewshot,
                    random_seed=seed,
                    numpy_random_seed=seed,
                    torch_random_seed=seed,
                    fewshot_random_seed=seed,
                    bootstrap_iters=0,
                    log_samples=False,
                )
            finally:
                model.train(was_training)
        if out is None:
            return {}
        record = flatten_results(out["results"])
        return {k: v for k, v in record.items() if not math.isnan(v)}


def build_in_loop_eval(core: CoreParts, metrics: Metrics) -> InLoopEval:
    """The ``after_step`` seam's builder with ``eval.enabled`` (features/registry.py)."""
    return InLoopEval(core, metrics, core.config.eval)
