"""Which part of the model a run's checkpoints hold: the seam a feature that trains part of a model fills.

A run that trains the whole model saves and loads every key (``WHOLE_MODEL``). A feature that trains only some
parameters on a frozen base (LoRA's adapters: lora/checkpoint.py builds its scope) says, once, everything the
checkpointer must know about it, so checkpointing/ never names the feature:

* ``saved``: the keys a full checkpoint's model part holds (the trained ones);
* ``base``: the keys a seed, an initial load (a checkpoint or a Hugging Face folder) fills: the frozen base,
  re-read on every start, resume included;
* ``name`` and ``record``: what every marker records about it (``marker["model"][name] = record``, and
  ``marker["model"]["scope"] = name``), read back by the conversion scripts;
* ``fresh_start``: loads the trained part on a fresh start (e.g. a PEFT adapter folder); returns what it loaded
  for the summary, or None;
* ``export_hf``: ``checkpoint.last_save_in_hf`` for such a checkpoint (``export_to_hf`` writes whole models).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ModelScope:
    """The part of the model a run's checkpoints hold (module docstring); the default is the whole model."""

    name: str | None = None
    saved: Callable[[str], bool] | None = None
    base: Callable[[str], bool] | None = None
    record: dict[str, Any] = field(default_factory=dict)
    fresh_start: Callable[[nn.Module, dict[str, Any]], str | None] | None = None
    export_hf: Callable[[str, str, torch.dtype | None], Any] | None = None

    @property
    def partial(self) -> bool:
        """A full checkpoint does not hold the base: it comes from the seed or the initial load on every start."""
        return self.saved is not None

    def keys(self, full: bool) -> Callable[[str], bool] | None:
        """The model keys a full checkpoint (``full``) or a seed / initial load holds; None: every key."""
        return self.saved if full else self.base

    def model_info(self, info: dict[str, Any]) -> dict[str, Any]:
        """``info`` (the model's record) with this scope's own record under its name, and its name."""
        return {**info, self.name: self.record, "scope": self.name} if self.name else info


WHOLE_MODEL = ModelScope()


def partial_scope_of(model_record: dict[str, Any]) -> str | None:
    """The name of the partial scope a marker's model record was saved under (e.g. an adapters-only checkpoint),
    or None for a whole model."""
    return model_record.get("scope")
