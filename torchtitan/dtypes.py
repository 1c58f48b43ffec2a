"""The config's dtype names -> torch dtypes, in one table (a leaf: imports only torch).

Config keys such as ``training.mixed_precision_param`` and ``checkpoint.export_dtype`` take these
names; the config schema's ``Literal`` types restrict each key to the subset it supports.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a KeyError for a name not in ``DTYPES``."""
    return DTYPES[name]
