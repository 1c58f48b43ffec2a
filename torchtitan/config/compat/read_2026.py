"""An upstream torchtitan 2026 ``Trainer.Config`` (the stand-ins of config/compat/upstream_2026) -> this trainer's
``{section: {key: value}}`` tables, by the rules of config/compat/keys_2026.py. Every refusal is one line naming
the recipe function and the field; the speed-only fields are said once each, in a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from torchtitan.config.compat.keys_2026 import RULES, To, Warns
from torchtitan.config.compat.spellings import Fixed
from torchtitan.config.compat.upstream_2026 import classes as c
from torchtitan.config.errors import ConfigError

logger = logging.getLogger(__name__)

_LEAF_SECTIONS = (
    "profiler", "metrics", "optimizer", "lr_scheduler", "training", "parallelism", "checkpoint", "compile", "comm",
    "validator", "debug", "override",
)  # fmt: skip
_FUSED_OVERRIDES = (
    "torchtitan.overrides.fused_swiglu.fused_swiglu",
    "torchtitan.overrides.fused_swiglu.fused_grouped_experts",
)
_KERNEL_BACKENDS = {"flex": None, "flex_flash": "FlexAttention's flash backend", "varlen": "FA3's varlen kernel"}


class _Reader:
    def __init__(self, config: c.TrainerConfig, where: str):
        self.config, self.where = config, where
        self.out: dict[str, Any] = {}

    def refuse(self, path: str, value: Any, why: str, kind: type[Exception] = NotImplementedError) -> Exception:
        return kind(f"{self.where}: Trainer.Config.{path} = {value!r}: {why}")

    def warn(self, path: str, value: Any, why: str) -> None:
        logger.warning("%s: Trainer.Config.%s = %r: %s", self.where, path, value, why)

    def set(self, key: str, value: Any) -> None:
        self.out[key] = value


def _leaves(config: c.TrainerConfig, where: str) -> Iterator[tuple[str, Any]]:
    for f in dataclasses.fields(c.TrainerConfig):
        value = getattr(config, f.name)
        if f.name in _LEAF_SECTIONS:
            expected = type(getattr(c.TrainerConfig(), f.name))
            if not isinstance(value, expected):
                raise ConfigError(
                    f"{where}: Trainer.Config.{f.name} is a {type(value).__name__}, expected upstream's "
                    f"{expected.__name__} (set its fields: config.{f.name}.KEY = VALUE)"
                )
            for g in dataclasses.fields(value):
                if f"{f.name}.{g.name}" in RULES:
                    yield f"{f.name}.{g.name}", getattr(value, g.name)
        else:
            yield f.name, value
    ac = config.activation_checkpoint
    if isinstance(ac, c.ActivationCheckpointConfig):
        for g in dataclasses.fields(ac):
            yield f"activation_checkpoint.{g.name}", getattr(ac, g.name)
    yield "validator.dataloader", config.validator.dataloader


def _tokens(r: _Reader) -> None:
    t, p = r.config.training, r.config.parallelism
    length, micro, step = t.max_context_length, t.num_tokens_per_microbatch_per_dp_rank, t.num_tokens_per_train_step
    key = "training.num_tokens_per_microbatch_per_dp_rank"
    if length < 1 or micro < 1 or micro % length:
        raise r.refuse(key, micro, f"must be a positive multiple of max_context_length ({length}): whole sequences "
                       "here (set a multiple)", ConfigError)  # fmt: skip
    samples, n_pp = micro // length, p.num_pp_microbatches
    if n_pp < 1:
        raise r.refuse("parallelism.num_pp_microbatches", n_pp, "must be >= 1", ConfigError)
    if p.pipeline_parallel_degree > 1:
        r.set("training.batch_size", samples * n_pp)
        r.set("experimental.pipeline_parallel_microbatches", n_pp)
    elif n_pp != 1:
        raise r.refuse("parallelism.num_pp_microbatches", n_pp, "acts with pipeline parallel only; set 1", ConfigError)
    else:
        r.set("training.batch_size", samples)
    r.set("training.seq_len", length)
    if step != -1:
        if step < 1 or step % length:
            raise r.refuse("training.num_tokens_per_train_step", step, f"must be -1 or a multiple of "
                           f"max_context_length ({length})", ConfigError)  # fmt: skip
        r.set("training.global_batch_size", step // length)  # 2025's rule divides by batch_size x dp


def _model(r: _Reader) -> None:
    spec = r.config.model_spec
    if not isinstance(spec, c.ModelSpec):
        raise r.refuse("model_spec", spec, "a recipe sets it from a family's registry (llama3_debugmodel() ...)",
                       ConfigError)  # fmt: skip
    r.set("model.name", spec.name)
    r.set("model.flavor", spec.flavor)
    if spec.attn_backend not in _KERNEL_BACKENDS:
        raise r.refuse("model_spec.attn_backend", spec.attn_backend, f"allowed: {', '.join(_KERNEL_BACKENDS)}",
                       ConfigError)  # fmt: skip
    if _KERNEL_BACKENDS[spec.attn_backend]:
        r.warn("model_spec.attn_backend", spec.attn_backend, f"speed only: {_KERNEL_BACKENDS[spec.attn_backend]} is "
               "not used here; the same per-document masking runs through model.attention_backend 'auto'")  # fmt: skip
    r.set("model.attn_mask_type", "block_causal")  # upstream's language models always mask per document
    r.set("model.positions_per_document", True)
    for conv in spec.converters:
        if isinstance(conv, c.Float8Converter):
            if conv.emulate:
                raise r.refuse("model_spec.converters[Float8LinearConverter].emulate", True,
                               "emulated float8 GEMMs are not built (float8 here needs torchao and a device that "
                               "runs torch._scaled_mm)")  # fmt: skip
            r.set("float8.enable_float8_linear", True)
        elif isinstance(conv, c.LoRAConverter):
            names = [
                n for m in conv.target_modules for n in {"wkv": ["wk", "wv"], "wqkv": ["wq", "wk", "wv"]}.get(m, [m])
            ]
            r.out.update({"lora.enable": True, "lora.rank": conv.rank, "lora.alpha": conv.alpha,
                          "lora.target_modules": names})  # fmt: skip
        else:
            raise r.refuse("model_spec.converters", conv, "converters here: Float8LinearConverter, LoRAConverter")


def _data(r: _Reader, path: str, data: Any, section: str) -> None:
    if not isinstance(data, c.Data) or (data.dataset is None and data.path is None):
        raise r.refuse(path, data, "a dataset of upstream's DATASETS or a local file", ConfigError)
    if data.dataset is not None:
        r.set(f"{section}.dataset", data.dataset)
    if data.path is not None:
        r.set(f"{section}.dataset_path", data.path)
    if section == "training" and data.chat:
        r.out.update({"training.dataset_format": "chat", "training.loss_on": "assistant"})
    if section == "training" and data.shuffle:
        r.warn(f"{path}.shuffle", True, "the data is read in order here, not shuffled: the batches differ")


def _loss(r: _Reader) -> None:
    loss, length = r.config.loss, r.config.training.max_context_length
    if not isinstance(loss, c.Loss):
        raise r.refuse("loss", loss, "ChunkedLossWrapper or CrossEntropyLoss", ConfigError)
    if loss.chunked and (loss.num_chunks < 1 or length % loss.num_chunks):
        raise r.refuse("loss.num_chunks", loss.num_chunks, f"must divide max_context_length ({length})", ConfigError)
    compiled = r.config.compile.enable and "loss" in r.config.compile.components
    piped = r.config.parallelism.pipeline_parallel_degree > 1
    if loss.chunked and (compiled or piped):  # ours: the compiled loss and the pipeline's are full-logits ones
        why = "the loss compiled" if compiled else "pipeline parallel (the last stage's loss)"
        r.warn("loss", f"ChunkedLossWrapper(num_chunks={loss.num_chunks})", f"with {why} it runs here over the full "
               "logits, in one chunk (the same loss; chunking changes memory only)")  # fmt: skip
    chunked = loss.chunked and not compiled and not piped
    r.set("training.loss_chunk_size", length // loss.num_chunks if chunked else 0)


def _ac(r: _Reader) -> None:
    ac = r.config.activation_checkpoint
    if ac is None:
        r.set("activation_checkpoint.mode", "none")
    elif isinstance(ac, c.FullACConfig):
        r.set("activation_checkpoint.mode", "full")
    elif isinstance(ac, c.SelectiveACConfig):
        r.out.update({"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "op"})
    elif isinstance(ac, c.MemoryBudgetACConfig):
        r.out.update(
            {"activation_checkpoint.mode": "memory_budget", "activation_checkpoint.memory_budget": ac.memory_budget}
        )
    else:
        raise r.refuse("activation_checkpoint", ac, "None, FullAC.Config(), SelectiveAC.Config() or "
                       "MemoryBudgetAC.Config()", ConfigError)  # fmt: skip


def _param_groups(r: _Reader) -> None:
    groups = r.config.optimizer.param_groups
    path = "optimizer.param_groups"
    if len(groups) != 1 or groups[0].pattern != r".*" or groups[0].optimizer_name not in ("AdamW", "Adam"):
        raise r.refuse(path, groups, "one AdamW or Adam group over every parameter (pattern '.*', "
                       "default_adamw(lr=...)) is built; per-group rules: optimizer.param_groups in a TOML")  # fmt: skip
    kwargs = dict(groups[0].optimizer_kwargs)
    unknown = set(kwargs) - {"lr", "betas", "eps", "weight_decay"}
    if unknown:
        raise r.refuse(path, groups, f"optimizer arguments {sorted(unknown)} are not built; lr, betas, eps, "
                       "weight_decay are")  # fmt: skip
    r.set("optimizer.name", groups[0].optimizer_name)
    for ours, theirs in (("lr", "lr"), ("eps", "eps"), ("weight_decay", "weight_decay")):
        if theirs in kwargs:
            r.set(f"optimizer.{ours}", kwargs[theirs])
    if "betas" in kwargs:
        r.set("optimizer.beta1", kwargs["betas"][0])
        r.set("optimizer.beta2", kwargs["betas"][1])


def _overrides(r: _Reader) -> None:
    for name in r.config.override.imports:
        if name not in _FUSED_OVERRIDES:
            raise r.refuse("override.imports", r.config.override.imports, f"{name!r} is not built; the fused SwiGLU "
                           "overrides are (speed only)")  # fmt: skip
        r.warn("override.imports", name, "no effect here (speed only: the same SwiGLU math, gate and up fused in one "
               "GEMM upstream; two here)")  # fmt: skip


_COMPUTED = {
    "model_spec": _model,
    "dataloader": lambda r: _data(r, "dataloader", r.config.dataloader, "training"),
    "validator.dataloader": lambda r: (
        r.config.validator.enable and _data(r, "validator.dataloader", r.config.validator.dataloader, "validation")
    ),
    "loss": _loss,
    "activation_checkpoint": _ac,
    "training.num_tokens_per_microbatch_per_dp_rank": _tokens,
    "optimizer.param_groups": _param_groups,
    "override.imports": _overrides,
}


def _apply(r: _Reader, path: str, value: Any) -> None:
    rule = RULES[path]
    off = {"checkpoint.": r.config.checkpoint.enable, "validator.": r.config.validator.enable}
    if isinstance(rule, To) and any(path.startswith(s) and not on for s, on in off.items()) and path[-7:] != ".enable":
        return  # upstream's values of a section act only with it on (here a given one would be warned about)
    if isinstance(rule, To):
        try:
            r.set(rule.target, rule.convert(value) if rule.convert else value)
        except (ConfigError, NotImplementedError) as e:
            raise r.refuse(path, value, str(e), type(e)) from None
        r.out.update(rule.extra(value) if rule.extra else {})
        if rule.said and (note := rule.said(value)):
            r.warn(path, value, note)
    elif isinstance(rule, Fixed):
        if not rule.accepts(value):
            allowed = " or ".join(repr(v) for v in (rule.value, *rule.also))
            raise r.refuse(path, value, f"{rule.why}; accepted: {allowed}")
    elif isinstance(rule, Warns):
        active = not rule.only_with_pp or r.config.parallelism.pipeline_parallel_degree > 1
        if active and value != rule.quiet:
            r.warn(path, value, f"no effect here ({rule.why})")
    elif path in _COMPUTED:
        _COMPUTED[path](r)


def config_table_2026(config: c.TrainerConfig, where: str) -> dict[str, dict[str, Any]]:
    """The recipe's config in this trainer's keys, as a TOML file's tables (2025 spellings where their rule helps).

    Raises:
        ConfigError: a value of the wrong kind. NotImplementedError: a field at a value not built here.
    """
    r = _Reader(config, where)
    for path, value in _leaves(config, where):
        _apply(r, path, value)
    table: dict[str, dict[str, Any]] = {}
    for key, value in r.out.items():
        if value is None:
            continue  # as in a TOML file: absent (our default) is None
        section, _, name = key.partition(".")
        table.setdefault(section, {})[name] = value
    return table
