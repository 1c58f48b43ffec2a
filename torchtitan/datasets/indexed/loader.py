"""The layout-invariant loader of indexed datasets and weighted blends (windows read on demand, format.py).

Invariant (as for text streams, hf_datasets.py): the samples of global batch k are a function of k only.
Row s of step t is global sample ``n = t * S + s`` (S = num_streams). Megatron's blending rule (blend.py),
run over the global sample order, gives n's source j and its local sample index (the j-th source's count
before n); the source maps that index to a window of its token stream in a seeded per-epoch order
(sources.py). Every rank computes the whole step's plan (S rows: cheap) and reads only its own rows, so
data-parallel degree, micro-batching and resume change nothing.

State: windows yielded per stream (as text streams: merged across ranks for another data-parallel degree),
plus the mix (sources, weights) and, at the step the lowest stream is on, every source's samples taken in
all and since the mix started: a resume continues at the exact next sample of every source.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.config.errors import ConfigError
from torchtitan.config.mix import MIX_KEY, MixEntry
from torchtitan.datasets.hf_datasets import ParallelAwareDataloader, first_group, validate_groups
from torchtitan.datasets.indexed.blend import BlendRule
from torchtitan.datasets.indexed.sources import WindowSource, build_sources
from torchtitan.datasets.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
RESTART_KEY = "training.dataset_mix_restart"


class BlendedDataset(IterableDataset, Stateful):
    """Yields, forever, one (input, label) micro-batch per stream group, groups in order each step; each a pair
    of LongTensors of shape (len(group), seq_len)."""

    def __init__(
        self,
        sources: list[WindowSource],
        weights: list[float],
        seq_len: int,
        stream_groups: list[list[int]],
        num_streams: int,
        *,
        restart_mix: bool = False,
    ) -> None:
        validate_groups(stream_groups, num_streams)
        self.sources, self.weights = sources, [float(w) for w in weights]
        self._seq_len, self._num_streams = seq_len, num_streams
        self._groups = [list(g) for g in stream_groups]
        self._windows = {s: 0 for g in self._groups for s in g}
        self._restart_mix = restart_mix
        self._step, self._taken = -1, []  # the step planned, and each source's samples in it
        self._previous: tuple[int, list[int]] = (-1, [])  # the step planned before, and its counts
        self._mix_start = 0  # the step the mix (its weights) started at: 0, or a restart's checkpoint step
        self._set_step(0, [0] * len(sources), [0] * len(sources))

    def _set_step(self, step: int, consumed: list[int], mixed: list[int]) -> None:
        """Plan step ``step``, given every source's samples taken before it in all and since the mix started."""
        self._previous = (self._step, self._taken)
        self._step, self._consumed, self._mixed = step, list(consumed), list(mixed)
        rule = BlendRule(self.weights, mixed)
        taken = [0] * len(self.sources)
        self._plan: list[tuple[int, int]] = []  # (source, local sample index) of each row of the step
        for _ in range(self._num_streams):
            j = rule.next()
            self._plan.append((j, consumed[j] + taken[j]))
            taken[j] += 1
        self._taken = taken

    def _plan_for(self, step: int) -> list[tuple[int, int]]:
        if step == self._step + 1:
            after = [c + t for c, t in zip(self._consumed, self._taken)]
            self._set_step(step, after, [m + t for m, t in zip(self._mixed, self._taken)])
        assert step == self._step, f"planned step {self._step}, asked for {step}"
        return self._plan

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        first = first_group([[self._windows[s] for s in g] for g in self._groups])
        while True:
            for group in self._groups[first:]:
                plan = self._plan_for(self._windows[group[0]])
                rows = np.stack([self.sources[j].sample(i) for j, i in (plan[s] for s in group)])
                for s in group:
                    self._windows[s] += 1
                windows = torch.from_numpy(rows.astype(np.int64))  # (len(group), seq_len + 1)
                yield windows[:, :-1], windows[:, 1:]
            first = 0

    def step_metrics(self) -> tuple[dict[str, Any], dict[str, float]]:
        """The samples and tokens each source gave the last step this rank finished reading (counts of the whole
        global batch: the same on every rank and layout)."""
        done = min(self._windows.values()) - 1
        taken = self._taken if done == self._step else self._previous[1] if done == self._previous[0] else None
        samples = dict(zip((s.name for s in self.sources), taken or [0] * len(self.sources)))
        tokens = {n: c * self._seq_len for n, c in samples.items()}
        scalars = {f"data_samples/{n}": float(c) for n, c in samples.items()}
        return {"data_samples": samples, "data_tokens": tokens}, scalars

    def _blend_state(self, step: int) -> dict[str, Any]:
        consumed, mixed = self._consumed, self._mixed
        if step == self._step + 1:
            consumed = [c + t for c, t in zip(consumed, self._taken)]
            mixed = [m + t for m, t in zip(mixed, self._taken)]
        assert step in (self._step, self._step + 1), f"state at step {step}, planned {self._step}"
        return {"step": step, "consumed": consumed, "mixed": mixed, "mix_start": self._mix_start}

    def state_dict(self) -> dict[str, Any]:
        step = min(self._windows.values())
        return {
            "kind": "indexed",
            "num_streams": self._num_streams,
            "seq_len": self._seq_len,
            "mix": {"sources": [s.name for s in self.sources], "weights": self.weights},
            "blend": self._blend_state(step),
            "streams": {str(s): {"windows": w} for s, w in self._windows.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the streams this rank owns (from the merged states of every saved rank) and the blend."""
        if state_dict.get("kind") != "indexed":
            what = "fine-tuning data" if state_dict.get("kind") == "sft" else "text streams (training.dataset_path)"
            raise ConfigError(
                f"the checkpoint's data state is {what}; this run reads indexed data or a blend: start the data "
                'from the beginning with checkpoint.exclude_from_loading = ["dataloader"]'
            )
        saved = (state_dict["num_streams"], state_dict["seq_len"])
        if saved != (self._num_streams, self._seq_len):
            raise ValueError(
                f"data state has (num_streams, seq_len) = {saved}, this run {(self._num_streams, self._seq_len)}; "
                "keep the global batch size (dp * local_batch_size * grad_accum_steps) and seq_len to resume"
            )
        missing = [s for s in self._windows if str(s) not in state_dict["streams"]]
        if missing:
            raise ValueError(f"data state lacks streams {missing} owned by this rank; load the merged states")
        windows = {s: int(state_dict["streams"][str(s)]["windows"]) for s in self._windows}
        blend = state_dict["blend"]
        step = int(blend["step"])
        if min(windows.values()) != step:
            raise ValueError(f"data state's blend is at step {step}, its streams at {min(windows.values())}")
        consumed, mixed, mix_start = self._resume_mix(state_dict["mix"], blend)
        self._windows = windows
        first_group([[windows[s] for s in g] for g in self._groups])  # a step boundary or a prefix of one
        self._mix_start = mix_start
        self._set_step(step, consumed, mixed)
        self._previous = (-1, [])

    def _resume_mix(self, mix: dict[str, Any], blend: dict[str, Any]) -> tuple[list[int], list[int], int]:
        """(consumed, mixed, mix start) to resume with: the checkpoint's for the same mix; for another mix with
        ``training.dataset_mix_restart``, each kept source at its position and the rule restarted."""
        names, weights = list(mix["sources"]), [float(w) for w in mix["weights"]]
        mine = [s.name for s in self.sources]
        if names == mine and np.allclose(weights, self.weights, rtol=0, atol=1e-12):
            return [int(c) for c in blend["consumed"]], [int(m) for m in blend["mixed"]], int(blend["mix_start"])
        if not self._restart_mix:
            raise ConfigError(
                f"{MIX_KEY} differs from the checkpoint's: saved {_describe(names, weights)}, now "
                f"{_describe(mine, self.weights)}; resume with the saved mix, or set {RESTART_KEY} = true to restart "
                "the mix at the checkpoint's step (each kept source goes on where it stopped)"
            )
        position = dict(zip(names, (int(c) for c in blend["consumed"])))
        consumed = [position.get(n, 0) for n in mine]
        logger.warning(
            "%s: the mix restarts at step %d with %s (was %s); sources go on at %s samples",
            RESTART_KEY,
            int(blend["step"]),
            _describe(mine, self.weights),
            _describe(names, weights),
            consumed,
        )
        return consumed, [0] * len(mine), int(blend["step"])


class IndexedDataloader(ParallelAwareDataloader):
    """The loader over a ``BlendedDataset``: it also reports each source's samples per step (``ReportsDataMix``)."""

    def step_metrics(self) -> tuple[dict[str, Any], dict[str, float]]:
        return self.dataset.step_metrics()


def _describe(names: list[str], weights: list[float]) -> str:
    return "[" + ", ".join(f"{n}:{w:.6g}" for n, w in zip(names, weights)) + "]"


def build_indexed_data_loader(
    mix: list[MixEntry],
    tokenizer: Tokenizer,
    seq_len: int,
    stream_groups: list[list[int]],
    num_streams: int,
    *,
    seed: int = 0,
    restart_mix: bool = False,
    key: str = MIX_KEY,
) -> IndexedDataloader:
    """The loader of one data-parallel rank over a blend (or one indexed dataset: a mix of one)."""
    sources = build_sources([e.source for e in mix], tokenizer, seq_len, seed, key)
    for entry, source in zip(mix, sources):
        logger.info(
            "data source %s: weight %.4g, %d tokens, %d windows of %d",
            entry.source,
            entry.weight,
            source.num_tokens,
            source.num_windows,
            seq_len + 1,
        )
    weights = [e.weight for e in mix]
    dataset = BlendedDataset(sources, weights, seq_len, stream_groups, num_streams, restart_mix=restart_mix)
    return IndexedDataloader(dataset)
