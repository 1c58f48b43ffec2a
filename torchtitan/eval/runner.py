"""The model side of an evaluation: score batches of (context, continuation) tokens and generate, under any
layout the model was built with.

Data-parallel ranks (FSDP2) split the scoring batches round-robin and every rank gets every result back
(``all_gather_object`` over the dp group), so each rank's lm-eval sees the whole list and computes the same
metrics; tensor-parallel ranks of one dp rank run the same batches together. Each dp rank runs as many forward
passes as the others (a rank short of batches repeats one and drops its result): under FSDP a forward is a
collective. Generation runs every request on every rank, in lockstep: the number of tokens a batch runs for
depends on when its rows stop, which all ranks must agree on.

Under tensor parallel the model is the training one, whose sequence parallel splits every sequence evenly over
the TP ranks: inputs are right-padded to a multiple of the TP degree (a causal model's earlier positions do not
see the padding), and generation runs without the KV cache (one new token does not split), the whole sequence
each step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan.components.generation import KVCache, Sampling

if TYPE_CHECKING:
    from torchtitan.eval.model import EvalModel

# a continuation's (sum of its log-probabilities, whether it is greedy)
Scored = tuple[float, bool]
# one forward row: context, continuation, and every continuation scored on the same input (context +
# continuation[:-1] equal: the choices of a multiple-choice question whose last token differs, as hf groups them)
Row = tuple[list[int], list[int], list[list[int]]]


class ModelRunner:
    """Forward passes and generation on an ``EvalModel``; ``max_length``: the longest input a forward gets."""

    def __init__(self, em: EvalModel, max_length: int):
        self.em, self.max_length = em, max_length
        self.dp_group = em.world.group("dp") if em.world.dims.dp_degree > 1 else None
        self.dp_rank, self.dp_degree = em.world.local_rank("dp"), em.world.dims.dp_degree
        self.multiple = em.world.dims.tp  # sequence parallel: every input's length a multiple of this

    def _padded(self, rows: Sequence[list[int]]) -> torch.Tensor:
        """Right-padded (bs, width) ids, width a multiple of the TP degree."""
        width = -(-max(len(x) for x in rows) // self.multiple) * self.multiple
        batch = torch.zeros(len(rows), width, dtype=torch.long)
        for i, x in enumerate(rows):
            batch[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        return batch.to(self.em.device)

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (bs, n) -> fp32 logits (bs, n, vocab), whole on every rank (TP's vocab shards gathered)."""
        em = self.em
        amp = torch.autocast(em.device.type, dtype=em.amp_dtype) if em.amp_dtype else contextlib.nullcontext()
        with torch.no_grad(), amp, em.forwards():
            out = em.model(tokens) if positions is None else em.model(tokens, positions=positions)
        if hasattr(out, "full_tensor"):  # a DTensor: the TP head's vocab-sharded logits (loss parallel)
            out = out.full_tensor()
        return out.float()

    def score(self, batches: Sequence[Sequence[Row]]) -> list[list[list[Scored]]]:
        """Each batch's rows scored as lm-eval's hf backend does (inputs cut to ``max_length`` from the left,
        right-padded; each row's continuations on its one input); this dp rank runs its share and every rank
        returns all of them: [batch][row][continuation]."""
        dp, rank = self.dp_degree, self.dp_rank
        mine = list(range(rank, len(batches), dp))
        rounds = math.ceil(len(batches) / dp) if batches else 0
        results: list[list[list[Scored]]] = []
        for i in range(rounds):  # every dp rank runs `rounds` forwards
            index = mine[i] if i < len(mine) else 0
            scored = self._score_batch(batches[index])
            if i < len(mine):
                results.append(scored)
        if dp == 1:
            return results
        gathered: list[list[list[list[Scored]]] | None] = [None] * dp
        dist.all_gather_object(gathered, results, group=self.dp_group)
        return [gathered[i % dp][i // dp] for i in range(len(batches))]  # type: ignore[index]

    def _score_batch(self, rows: Sequence[Row]) -> list[list[Scored]]:
        inputs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for ctx, cont, _ in rows]
        logprobs = F.log_softmax(self.logits(self._padded(inputs)), dim=-1)  # (bs, width, vocab)
        out = []
        for i, (x, (_, _, conts)) in enumerate(zip(inputs, rows)):
            scored = []
            for cont in conts:
                picked = logprobs[i, len(x) - len(cont) : len(x)]  # (len(cont), vocab): the continuation's positions
                target = torch.tensor(cont, dtype=torch.long, device=picked.device)
                greedy = bool((picked.argmax(dim=-1) == target).all())
                scored.append((float(picked.gather(1, target[:, None]).sum()), greedy))
            out.append(scored)
        return out

    @torch.no_grad()
    def generate(
        self,
        contexts: list[list[int]],
        max_new_tokens: int,
        sampling: Sampling,
        stopped: Callable[[list[int]], bool],
        generator: torch.Generator | None,
    ) -> list[list[int]]:
        """Continue each context (all of one length), with our KV cache where it fits, until ``stopped(row's new
        tokens)`` for every row or ``max_new_tokens``; returns each row's new tokens, cut after the step that stopped
        it."""
        tokens = torch.tensor(contexts, dtype=torch.long, device=self.em.device)  # (bs, n)
        n = tokens.shape[1]
        cache = KVCache(n + max_new_tokens) if self.multiple == 1 and KVCache.fits(self.em.model) else None
        swapped = cache.install(self.em.model) if cache is not None else []
        done = [False] * len(contexts)
        ends = [max_new_tokens] * len(contexts)
        try:
            for step in range(max_new_tokens):
                if cache is None:  # the whole sequence, padded for sequence parallel
                    logits = self.logits(self._padded(tokens.tolist()))[:, tokens.shape[1] - 1]  # (bs, vocab)
                else:  # only the tokens not yet cached, at their true positions
                    new = tokens[:, cache.length :]
                    positions = torch.arange(cache.length, tokens.shape[1], device=tokens.device)
                    logits = self.logits(new, positions)[:, -1]  # (bs, vocab)
                    cache.length = tokens.shape[1]
                tokens = torch.cat([tokens, sampling.pick(logits, generator)[:, None]], dim=1)
                rows = tokens[:, n:].tolist()
                for i, row in enumerate(rows):
                    if not done[i] and stopped(row):
                        done[i], ends[i] = True, step + 1
                if all(done):
                    break
        finally:
            KVCache.uninstall(swapped)
        out = tokens[:, n:].tolist()
        return [row[:end] for row, end in zip(out, ends)]
