"""Does a checkpoint fit the run that loads it? The model it records must be the model being built.

A marker records the model's name and its args (``model_info``). Keys and shapes are checked by DCP,
but some changes keep both (``norm_type`` rmsnorm -> layernorm, ``rope_theta``, ``norm_eps``, the MoE
score function): those would load and silently train another model, so every model-defining arg is
compared. Args that only size buffers or steer training (below) may change on resume.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from torchtitan.datasets.tokenizer import tokenizer_digest

logger = logging.getLogger(__name__)

# May differ between the checkpoint and the run: a RoPE cache length (follows training.seq_len),
# init-only choices, MoE balancing hyper-parameters, kernel choices with the same numbers (the
# block-causal attention backend follows the device), and the estimator's assumed routing.
NOT_MODEL_DEFINING = frozenset(
    {
        "max_seq_len",
        "depth_init",
        "load_balance",
        "aux_loss_coeff",
        "bias_update_rate",
        "use_grouped_mm",
        "attention_backend",
        "balanced_routing",
    }
)
# Args added after markers began recording them, with the value that builds the model a marker without them
# recorded (a new option whose default is the old behaviour).
ADDED_ARGS: dict[str, Any] = {"shared_expert_gate": False, "mrope_section": [11, 11, 10]}
# Spellings of one module (see models/llama/model.py build_norm).
_SAME = {"fused_rmsnorm": "rmsnorm"}


def check_model_matches(saved: dict[str, Any] | None, current: dict[str, Any], path: str) -> None:
    """Compare a marker's ``model`` entry with this run's.

    Raises:
        ValueError: naming every model-defining arg that differs, with both values.
    """
    if not saved or "args" not in saved or "args" not in current:
        return  # a marker from before model info was recorded: keys and shapes are still checked
    diffs = []
    if saved.get("name") != current.get("name"):
        diffs.append(f"model.name: checkpoint {saved.get('name')!r}, config {current.get('name')!r}")
    old, new = saved["args"], current["args"]
    for key in sorted(set(old) | set(new)):
        if key in NOT_MODEL_DEFINING:
            continue
        if _canonical(old.get(key, ADDED_ARGS.get(key))) != _canonical(new.get(key, ADDED_ARGS.get(key))):
            diffs.append(f"{key}: checkpoint {old.get(key)!r}, config {new.get(key)!r}")
    if diffs:
        raise ValueError(
            f"checkpoint {path} holds another model than the config builds ({'; '.join(diffs)}); set the "
            "config back (model.flavor / model.norm_type / ...) to resume, or start a new run in another "
            "job.dump_folder"
        )


def _canonical(value: Any) -> Any:
    """One spelling per value: a module's other name, and a tuple as the marker's JSON holds it (a list)."""
    if isinstance(value, tuple):
        return list(value)
    return _SAME.get(value, value) if isinstance(value, str) else value


_DATA_KEYS = {"tokenizer": "model.tokenizer_path"}  # a marker's data record -> the config key it came from
_BY_CONTENT = ("tokenizer", "tokenizer_sha256")  # compared by _tokenizer_changed, not as recorded


def warn_if_data_changed(saved: dict[str, Any] | None, current: dict[str, Any], path: str) -> list[str]:
    """A different dataset or tokenizer on resume is allowed (curricula do it) but said; returns the warnings."""
    if not saved:
        return []
    changed = [
        f"{_DATA_KEYS.get(key, f'training.{key}')}: checkpoint {saved[key]!r}, config {current.get(key)!r}"
        for key in sorted(current)
        # a record an older checkpoint lacks is no change
        if key not in _BY_CONTENT and key in saved and saved[key] != current.get(key)
    ]
    if _tokenizer_changed(saved, current):
        changed.append(f"model.tokenizer_path: checkpoint {saved['tokenizer']!r}, config {current.get('tokenizer')!r}")
    if changed:
        logger.warning(
            "resuming from %s with other data than it was trained on (%s); the data loader's position "
            "is the checkpoint's, read from the new data",
            path,
            "; ".join(changed),
        )
    return changed


def _tokenizer_changed(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether the checkpoint's tokenizer differs from the config's by content, not by where it lies: the marker's
    digest, or (a marker from before digests, which records only the path) the digest of the recorded path where
    it exists here. A recorded path that is not on this machine cannot be compared: no change is said (a checkout
    moved, or the checkpoint shipped from elsewhere, as tests/assets/checkpoints are)."""
    if "tokenizer" not in saved or "tokenizer_sha256" not in current:
        return False
    theirs = saved.get("tokenizer_sha256")
    if theirs is None and isinstance(saved["tokenizer"], str) and os.path.exists(saved["tokenizer"]):
        theirs = tokenizer_digest(saved["tokenizer"])
    return theirs is not None and theirs != current["tokenizer_sha256"]
