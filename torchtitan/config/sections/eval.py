"""The ``[eval]`` section of the config tree (torchtitan/config/schema.py holds the tree): downstream tasks of
lm-evaluation-harness run on the live model during training (torchtitan/features/in_loop_eval/loop.py, docs/evaluation.md)."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.config.bounds import Bound
from torchtitan.config.fields import POSITIVE as _POSITIVE
from torchtitan.config.fields import config_field as _f

# requests per forward of the torchtitan backend, in the loop and on `python -m torchtitan.eval` (lm-eval's own is 1)
DEFAULT_BATCH_SIZE = 8


@dataclass
class Eval:
    enabled: bool = _f(
        False,
        "evaluate the live model on lm-evaluation-harness `tasks` every `freq` steps and at the last step "
        "(needs the eval extra: pip install -e '.[eval]')",
    )
    tasks: list[str] = _f(
        [],
        "lm-eval task names: the shipped ones (arith_mc, arith_ppl), those under `include_path`, or lm-eval's own "
        "(those download their data: only where the hub is reachable)",
    )
    freq: int = _f(500, "evaluate every N training steps (and at the last step)", bound=_POSITIVE)
    limit: int | None = _f(
        None, "examples per task (the first N of its split); None = all", bound=Bound(ge=1, text=">= 1 or None")
    )
    num_fewshot: int | None = _f(None, "few-shot examples in each prompt; None = each task's own default")
    include_path: str | None = _f(None, "a folder of your own lm-eval task YAMLs (searched before the shipped tasks)")
    batch_size: int = _f(DEFAULT_BATCH_SIZE, "requests per forward pass (grouped by length)", bound=_POSITIVE)
    seed: int = _f(1234, "seed of few-shot sampling and of sampled generation (the training RNG is left untouched)")
