"""The typed config tree, a leaf (imports only itself): sections, parsing, bounds, --help, torchtitan 2025's keys.

``from torchtitan.config import JobConfig``: the config a ``--module M --config F`` function returns (config/as_code.py).
"""

from torchtitan.config.manager import JobConfig

__all__ = ["JobConfig"]
