"""Upstream torchtitan's 2026 recipe modules, run here: the one namespace their imports resolve to.

Upstream's recipes (``torchtitan_recipes/**``, functions returning its ``Trainer.Config``) import upstream's module
paths: ``torchtitan.trainer``, ``torchtitan.models.llama3.config_registry``,
``torchtitan.distributed.activation_checkpoint`` ... Some of those paths are modules of this package with other
contents, some are not modules here. So they are not added to the package: while ``--module`` imports a recipe
module and calls its function, ``aliased`` puts stand-in modules (``registry.MODULES``, built of ``classes``) at
those names in ``sys.modules`` and afterwards puts back whatever was there. It is on only for a module of upstream's
recipe package (``torchtitan_recipes.*``, or a file under a ``torchtitan_recipes/`` folder), so a module of ours
that imports ``torchtitan.distributed.activation_checkpoint`` always gets ours. A recipe written here may also
import the stand-ins directly: ``from torchtitan.config.compat.upstream_2026.registry import Trainer``.

What the returned ``Trainer.Config`` means here is config/compat/keys_2026.py (its rule table).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

from torchtitan.config.compat.upstream_2026.classes import TrainerConfig
from torchtitan.config.compat.upstream_2026.registry import MODULES

RECIPES_PACKAGE = "torchtitan_recipes"

__all__ = ["MODULES", "RECIPES_PACKAGE", "TrainerConfig", "aliased", "is_upstream_recipe"]


def is_upstream_recipe(module: str) -> bool:
    """``--module``'s value names a module of upstream's recipe package (dotted, or a file inside it)."""
    if module.endswith(".py") or os.sep in module or "/" in module:
        return RECIPES_PACKAGE in os.path.normpath(os.path.abspath(module)).split(os.sep)[:-1]
    return module.partition(".")[0] == RECIPES_PACKAGE


def _module(name: str, names: dict[str, object]) -> ModuleType:
    module = ModuleType(
        name, f"stand-in for upstream torchtitan 2026's {name} (torchtitan/config/compat/upstream_2026)"
    )
    module.__dict__.update(names)
    module.__getattr__ = lambda attr: _missing(name, attr, names)  # a name upstream has that is not here
    return module


def _missing(module: str, attr: str, names: dict[str, object]):
    if attr.startswith("__"):
        raise AttributeError(attr)
    raise ImportError(
        f"upstream torchtitan 2026's {module}.{attr} is not provided here; the stand-ins of {module}: "
        f"{', '.join(sorted(names))} (torchtitan/config/compat/upstream_2026/registry.py)"
    )


@contextlib.contextmanager
def aliased(active: bool = True) -> Iterator[None]:
    """Upstream's module names -> the stand-ins, in ``sys.modules``, for the duration (restored after)."""
    if not active:
        yield
        return
    saved = {name: sys.modules.get(name) for name in MODULES}
    sys.modules.update({name: _module(name, names) for name, names in MODULES.items()})
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
