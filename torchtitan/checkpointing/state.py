"""What goes into a checkpoint, as DCP ``Stateful`` objects, all keyed by whole-model FQNs.

Model and optimizer state use whole-model names (``layers.3.attention.wq.weight``) whatever the
layout, so DCP can reshard between FSDP, TP and PP layouts: each rank reads just the slices of the
keys it holds. The data loader state is saved per data-parallel rank and merged on load, so a
different data-parallel degree resumes every stream exactly where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

# Optimizer state as flat "state.<fqn>.<name>" / "param_groups.<fqn>.<name>" keys: per parameter,
# so a rank holding other stages' parameters after a PP change still finds its own.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelPartsView(nn.Module):
    """One module over a rank's model parts whose parameter names are whole-model FQNs.

    Pipeline stages are copies of the whole model with some children dropped (None) and a subset of
    ``layers``; the view registers each part's children (the same module objects, not copies) and
    merges their ``layers`` ModuleDicts. It is never called, only named: DCP's state-dict helpers map
    parameters to FQNs through it, and one optimizer over all parts maps onto it.
    """

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        for part in parts:
            for name, child in part.named_children():
                mine = self._modules.get(name)
                if isinstance(child, nn.ModuleDict) and (mine is None or isinstance(mine, nn.ModuleDict)):
                    if mine is None:
                        self.add_module(name, nn.ModuleDict())
                    overlap = set(self._modules[name]) & set(child)
                    assert not overlap, f"model parts share {name}.{sorted(overlap)}"
                    self._modules[name].update(child)
                else:
                    assert mine is None, f"two model parts own {name!r}"
                    self.add_module(name, child)
        direct = [n for part in parts for n, _ in part.named_parameters(recurse=False)]
        assert not direct, f"parameters registered on a model part itself are not supported: {direct}"


def build_model_view(parts: list[nn.Module]) -> nn.Module:
    return parts[0] if len(parts) == 1 else ModelPartsView(parts)


class ModelState(Stateful):
    """The model's weights; ``export_dtype`` casts them (a weights-only export); ``keys``: only the weights whose
    FQN it accepts (LoRA: the adapters in a checkpoint, the base from an initial load), the rest untouched."""

    def __init__(
        self, view: nn.Module, export_dtype: torch.dtype | None = None, keys: Callable[[str], bool] | None = None
    ):
        self.view = view
        self.export_dtype = export_dtype
        self.keys = keys

    def state_dict(self) -> dict[str, Any]:
        sd = get_model_state_dict(self.view)
        if self.keys is not None:
            sd = {k: v for k, v in sd.items() if self.keys(k)}
        if self.export_dtype is not None:
            sd = {k: v.to(self.export_dtype) for k, v in sd.items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.keys is None:
            set_model_state_dict(self.view, state_dict)  # strict: a key mismatch raises
            return
        # strict over the accepted keys: every one of them loaded, nothing else
        missing, unexpected = set_model_state_dict(self.view, state_dict, options=StateDictOptions(strict=False))
        wrong = [k for k in missing if self.keys(k)] + list(unexpected)
        assert not wrong, f"model keys not loaded / not wanted: {wrong[:5]}"


class OptimizerState(Stateful):
    def __init__(self, view: nn.Module, optimizer: torch.optim.Optimizer):
        self.view = view
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.view, self.optimizer, options=_OPTIM_OPTIONS)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.view, self.optimizer, state_dict, options=_OPTIM_OPTIONS)


class SavedKeysOnly(Stateful):
    """Loads only the keys of ``inner`` that a checkpoint holds (e.g. RNG states of ranks it had)."""

    def __init__(self, inner: Stateful, prefix: str, saved_keys: set[str]):
        self.inner = inner
        self.prefix = prefix
        self.saved_keys = saved_keys

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.inner.state_dict().items() if f"{self.prefix}.{k}" in self.saved_keys}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


class DataLoaderState(Stateful):
    """Saves this dp rank's loader state as ``dp_rank_<r>``; loads the merge of ``load_keys``.

    The state is JSON text (a DCP bytes entry): ranks of one dp rank (TP/PP peers) write the same
    key and DCP keeps one copy. To resume under another dp degree every rank reads all saved
    ranks' states, merges them (``merge_data_states``) and takes the streams it now owns.
    """

    def __init__(self, data_loader: Any, dp_rank: int, load_keys: list[str] | None = None):
        self.data_loader = data_loader
        self.dp_rank = dp_rank
        self.load_keys = load_keys

    def state_dict(self) -> dict[str, Any]:
        if self.load_keys is not None:
            return {key: "" for key in self.load_keys}  # placeholders DCP fills
        return {f"dp_rank_{self.dp_rank}": json.dumps(self.data_loader.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # lazy: a checkpoint manager without data (synthetic batches) runs without the data stack
        from torchtitan.datasets.hf_datasets import merge_data_states

        merged = merge_data_states([json.loads(text) for text in state_dict.values()])
        check_data_state(merged, self.data_loader.state_dict())
        self.data_loader.load_state_dict(merged)


def check_data_state(saved: dict[str, Any], mine: dict[str, Any]) -> None:
    """The saved data position fits this run: the same global batch (one stream per sample of it) and seq_len.

    Raises:
        ValueError: naming the config keys that set them, both values, and how to resume anyway.
    """
    (batch, seq), (my_batch, my_seq) = ((s["num_streams"], s["seq_len"]) for s in (saved, mine))
    if (batch, seq) == (my_batch, my_seq):
        return
    raise ValueError(
        f"the checkpoint's data position is for a global batch of {batch} samples x training.seq_len {seq}, this "
        f"run has {my_batch} x {my_seq} (global batch = data-parallel degree x training.batch_size x "
        "training.gradient_accumulation_steps); resume with the same global batch and training.seq_len, or "
        'start the data from the beginning with checkpoint.exclude_from_loading = ["dataloader"]'
    )


class TrainState(Stateful):
    """The step and this rank's RNG states (CPU and device), for a bit-exact resume.

    RNG keys are per rank (``rng_cpu.rank_<r>``): equal keys would be deduplicated by DCP. A
    resume on another world size finds no state for some ranks; they keep their seeded RNG.
    """

    def __init__(self, rank: int, device: torch.device):
        self.rank = rank
        self.device = device
        self.step = 0

    def _device_module(self):
        return None if self.device.type == "cpu" else torch.get_device_module(self.device)

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"step": self.step, f"rng_cpu.rank_{self.rank}": torch.get_rng_state()}
        if self._device_module() is not None:
            sd[f"rng_device.rank_{self.rank}"] = self._device_module().get_rng_state(self.device)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        if f"rng_cpu.rank_{self.rank}" in state_dict:
            torch.set_rng_state(state_dict[f"rng_cpu.rank_{self.rank}"])
        if f"rng_device.rank_{self.rank}" in state_dict:
            self._device_module().set_rng_state(state_dict[f"rng_device.rank_{self.rank}"], self.device)


def check_model_keys(model_sd: dict[str, Any], metadata: Any, path: str, all_rank_keys: set[str] | None) -> None:
    """Compare this rank's model keys and global shapes with a checkpoint's metadata.

    Args:
        all_rank_keys: the union of every rank's model keys (all stages under PP), to report
            checkpoint keys no rank wants (e.g. a bigger model flavor); None skips that check.

    Raises:
        ValueError: naming the missing/unexpected keys or the first shape mismatches.
    """
    saved = {k[len("model.") :]: md for k, md in metadata.state_dict_metadata.items() if k.startswith("model.")}
    missing = sorted(set(model_sd) - set(saved))
    problems = []
    if missing:
        problems.append(f"{len(missing)} model keys missing from the checkpoint, e.g. {missing[:3]}")
    if all_rank_keys is not None:
        unexpected = sorted(set(saved) - all_rank_keys)
        if unexpected:
            problems.append(f"{len(unexpected)} checkpoint keys this model does not have, e.g. {unexpected[:3]}")
    shapes = [
        f"{k}: checkpoint {tuple(saved[k].size)} vs model {tuple(v.shape)}"
        for k, v in model_sd.items()
        if k in saved and hasattr(saved[k], "size") and tuple(saved[k].size) != tuple(v.shape)
    ]
    if shapes:
        problems.append(f"{len(shapes)} shape mismatches, e.g. {shapes[:3]}")
    if problems:
        raise ValueError(
            f"checkpoint {path} does not match this model ({'; '.join(problems)}); was it saved with another "
            "model.flavor, norm type or tokenizer? Point checkpoint.folder elsewhere or fix the model config"
        )
