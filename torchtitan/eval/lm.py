"""``TorchtitanLM``: lm-evaluation-harness's model protocol over one of our models (registered as ``torchtitan``).

Tokenization, the context/continuation split, rolling windows, request order, batching and the post-processing
of generations follow lm-eval's own ``hf`` backend (its helpers are called, not copied), so on the same weights
and tokenizer both give the same requests and the same numbers (tests/runs/features/test_eval_runs.py). Requests are batched
by length (longest first, as hf does); generation requests of one batch share their context length, so no
padding enters the KV cache.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from torchtitan.components.generation import Sampling
from torchtitan.config.manager import JobConfig
from torchtitan.config.sections.eval import DEFAULT_BATCH_SIZE
from torchtitan.eval.model import EvalModel, build_eval_model, load_config
from torchtitan.eval.runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256
# generation kwargs this backend implements; any other is refused rather than ignored
_GEN_KEYS = {"do_sample", "temperature", "top_k", "until", "max_gen_toks"}


@register_model("torchtitan")
class TorchtitanLM(TemplateLM):
    """An lm-eval model over our model.

    Args (``--model_args`` on the command line, comma-separated ``key=value``):
        config: the training TOML (or a JobConfig): family, flavor, tokenizer and layout; with ``module``, the
            function of that module that returns it (``module=M,config=F``: ``--module M --config F``).
        checkpoint: a complete ``step-N`` DCP folder; hf: a Hugging Face folder instead; neither: seeded init.
        batch_size: requests per forward pass. max_length: longest input (default the config's seq_len).
        max_gen_toks: default generation budget. seed: seeds sampled generation.
        overrides: ``--section.key value`` pairs for the config, space-separated.
        model: an ``EvalModel`` already built (the trainer's live model); then config/checkpoint are not read.
    """

    def __init__(
        self,
        config: str | JobConfig | None = None,
        checkpoint: str | None = None,
        hf: str | None = None,
        batch_size: int | str = DEFAULT_BATCH_SIZE,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        seed: int = 1234,
        overrides: str | None = None,
        module: str | None = None,
        model: EvalModel | None = None,
        **unused: Any,
    ):
        super().__init__()
        unused = {k: v for k, v in unused.items() if v is not None and k not in ("device", "max_batch_size")}
        if unused:
            raise ValueError(f"--model_args {sorted(unused)}: not a torchtitan model argument; see docs/evaluation.md")
        if model is None:
            if config is None:
                raise ValueError(
                    "--model_args needs config=TRAIN_TOML, or module=M,config=F (and checkpoint=STEP_FOLDER or "
                    "hf=HF_FOLDER)"
                )
            job = load_config(config, overrides.split() if overrides else None, module=module)
            told = any(o.startswith("--model.tokenizer_path") for o in (overrides or "").split())
            model = build_eval_model(job, checkpoint=checkpoint, hf=hf, tokenizer_from_config=told)
        if str(batch_size).startswith("auto"):
            raise ValueError("batch_size=auto is not supported by the torchtitan backend; pass a number")
        self.em = model
        self.tokenizer_ = model.tokenizer
        self._batch_size = int(batch_size)
        self._max_length = int(max_length or model.max_seq_len)
        if self._max_length > model.max_seq_len:
            raise ValueError(
                f"max_length={self._max_length} is longer than the model's {model.max_seq_len} positions "
                "(training.seq_len); pass a smaller max_length or a larger --training.seq_len override"
            )
        self._max_gen_toks = int(max_gen_toks)
        self.runner = ModelRunner(model, self._max_length)
        self.generator = torch.Generator(model.device).manual_seed(int(seed))

    # --- what lm-eval asks of a model -------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer_.bos_id
        return bos if bos is not None and bos >= 0 else self.tokenizer_.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self.em.device

    @property
    def tokenizer_name(self) -> str:
        return "torchtitan"

    # every process runs lm-eval over all requests (rank 0 of 1, as under other TP launchers); the runner
    # shares the forward passes out over the data-parallel ranks itself
    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # as hf: by default the tokenizer's own special tokens (transformers' tokenizer(text): a bos only where its
        # post-processor adds one), unless the text starts with the prefix token; a task's special-token text
        # (<|im_end|>) is the special token, as in transformers
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(
                self.tok_decode([self.prefix_token_id], skip_special_tokens=False)
            )
        return self.tokenizer_.encode_prompt(string, add_special_tokens=add_special_tokens)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        model = getattr(self.tokenizer_, "model", None)
        if skip_special_tokens and hasattr(model, "decode") and hasattr(model, "token_to_id"):  # tokenizers.Tokenizer
            return model.decode(list(tokens), skip_special_tokens=True)
        return self.tokenizer_.decode(list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        # as hf: requests whose context + continuation[:-1] agree share one forward row (its longest continuation's)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, ctx, cont) in enumerate(requests):
            groups.setdefault(tuple(ctx + cont[:-1]), []).append(i)
        rows = [(max(members, key=lambda i: len(requests[i][2])), members) for members in groups.values()]
        rows.sort(
            key=lambda r: (-len(requests[r[0]][1] + requests[r[0]][2]), tuple(requests[r[0]][1] + requests[r[0]][2]))
        )
        chunks = [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        batches = [[(requests[rep][1], requests[rep][2], [requests[m][2] for m in members]) for rep, members in chunk]
                   for chunk in chunks]  # fmt: skip
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for chunk, scored in zip(chunks, self.runner.score(batches)):
            for (_, members), answers in zip(chunk, scored):
                for m, answer in zip(members, answers):
                    results[m] = answer
                    if requests[m][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[m][0], answer)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, counts = [], []
        for (string,) in [req.args for req in requests]:
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            mine = [(None, *lm_utils.make_disjoint_window(w)) for w in rolling]
            windows.extend(mine)
            counts.append(len(mine))
        scored = self._loglikelihood_tokens(windows)
        totals, at = [], 0
        for req, n in zip(requests, counts):
            total = sum(ll for ll, _ in scored[at : at + n])
            at += n
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        order = Collator([req.args for req in requests], sort_fn=lambda x: (-len(self.tok_encode(x[0])), x[0]),
                         group_by="gen_kwargs", group_fn=lambda x: x[1])  # fmt: skip
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        results = []
        for chunk in order.get_batched(n=0):  # one gen_kwargs group at a time, longest first
            contexts, all_kwargs = zip(*chunk)
            results.extend(self._generate_group(list(contexts), dict(all_kwargs[0]), eos))
        return order.get_original(results)

    def _generate_group(self, contexts: list[str], gen_kwargs: dict, eos: str) -> list[str]:
        unknown = sorted(set(gen_kwargs) - _GEN_KEYS - {"max_new_tokens", "max_tokens", "max_completion_tokens"})
        if unknown:
            raise ValueError(
                f"generation_kwargs {unknown}: not supported by the torchtitan backend (it has {sorted(_GEN_KEYS)})"
            )
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen = int(kwargs["max_gen_toks"])
        if max_gen >= self.max_length:
            raise ValueError(f"max_gen_toks {max_gen} leaves no room for a prompt in max_length {self.max_length}")
        # as lm-eval normalizes them: a missing temperature is 0.0, and do_sample at temperature 0 is greedy (it warns)
        temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
        sampling = Sampling(temperature, int(kwargs.get("top_k") or 0)) if temperature > 0 else Sampling()
        encoded = [self.tok_encode(c)[-(self.max_length - max_gen) :] for c in contexts]
        eot = self.eot_token_id

        def stopped(row: list[int]) -> bool:
            text = self.tok_decode(row, skip_special_tokens=False)
            return row[-1] == eot or any(stop and stop in text for stop in until)

        out: list[str | None] = [None] * len(contexts)
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(encoded):
            by_length.setdefault(len(ids), []).append(i)
        for length in sorted(by_length, reverse=True):  # same-length rows batch without padding
            rows = by_length[length]
            for start in range(0, len(rows), self.batch_size):
                batch = rows[start : start + self.batch_size]
                new = self.runner.generate([encoded[i] for i in batch], max_gen, sampling, stopped, self.generator)
                for i, toks in zip(batch, new):
                    text = postprocess_generated_text(self.tok_decode(toks), until, None)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", (contexts[i], gen_kwargs), text)
        return out  # type: ignore[return-value]
