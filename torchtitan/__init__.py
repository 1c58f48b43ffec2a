"""torchtitan: a PyTorch-native platform for training transformer language models (README.md, docs/design.md).

Modules that moved keep their old import paths: ``MOVED`` maps an old module (and everything under it) to its
new home, and importing the old name gives the new module itself (one module object, not a copy), with one
``FutureWarning`` naming the new path. A name the table does not know fails as usual.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

# old module -> new module; the longest matching prefix wins (the config sections moved apart from their features)
MOVED: dict[str, str] = {
    "torchtitan.lora": "torchtitan.features.lora",
    "torchtitan.lora.config": "torchtitan.config.sections.lora",
    "torchtitan.fault_tolerance": "torchtitan.features.fault_tolerance",
    "torchtitan.fault_tolerance.config": "torchtitan.config.sections.fault_tolerance",
    "torchtitan.rl": "torchtitan.features.rl",
    "torchtitan.rl.config": "torchtitan.config.sections.rl",
    "torchtitan.train_rl": "torchtitan.features.rl.step",
    "torchtitan.train_rl_estimate": "torchtitan.features.rl.estimate",
    "torchtitan.eval.loop": "torchtitan.features.in_loop_eval.loop",
    "torchtitan.eval.checks": "torchtitan.features.in_loop_eval.checks",
    "torchtitan.features.linear_attention": "torchtitan.models.qwen3_5.kernels",
}


_LONGEST_FIRST = sorted(MOVED, key=len, reverse=True)


def moved_to(name: str) -> str | None:
    """The new name of module ``name`` if it, or a package above it, moved (``MOVED``); else None."""
    for old in _LONGEST_FIRST:
        if name == old or name.startswith(old + "."):
            new = MOVED[old] + name[len(old) :]
            return new if new != name else None
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; import it from there", FutureWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import machinery set the old name's spec on it


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds an old module name: its spec loads the new module (``MOVED``)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not name.startswith("torchtitan."):
            return None
        new = moved_to(name)
        if new is None:
            return None
        target = importlib.util.find_spec(new)
        if target is None:
            return None  # the old name's submodule does not exist at the new home either: the usual error
        return importlib.machinery.ModuleSpec(
            name, _Alias(new), is_package=target.submodule_search_locations is not None
        )


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())
