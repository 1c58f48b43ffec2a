"""scripts/<name>.py loaded in this process (scripts/ is not a package): its ``main``, or the whole module."""

from __future__ import annotations

import functools
import importlib.util
import os

from tests.support.runs import ROOT


def script_main(name: str):
    """scripts/<name>.py's ``main``."""
    return script_module(name).main


def script_module(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def generate_script():
    """scripts/generate.py as a module, loaded once."""
    return script_module("generate")
