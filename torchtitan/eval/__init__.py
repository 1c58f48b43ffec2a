"""Downstream evaluation with lm-evaluation-harness (docs/evaluation.md).

``python -m torchtitan.eval --model torchtitan --model_args config=TOML,checkpoint=STEP ...``: lm-eval's own
command line with our model class registered. ``TorchtitanLM`` (torchtitan/eval/lm.py) for
``lm_eval.simple_evaluate(model=...)``; ``[eval]`` in a training config evaluates the live model (loop.py).
Importing this package needs nothing beyond torchtitan; ``TorchtitanLM`` needs the eval extra.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "TorchtitanLM":
        from torchtitan.eval.tasks import require_lm_eval

        require_lm_eval()
        from torchtitan.eval.lm import TorchtitanLM

        return TorchtitanLM
    raise AttributeError(name)
