"""torchtitan 2025 keys that need every source: settled once the TOML file and the flags are both in.

Refusals of a value (``Fixed``, a converter not built) wait until here, so that a flag may still override
the file's value; then a 2025 file's defaults (config/compat/keys_2025.py ``DEFAULTS``) and the family of its
qwen3 MoE flavors, then the keys that depend on others: ``compile.components`` on compile,
``training.global_batch_size`` on the batch and the data-parallel degree (so on the world size), the
pipeline keys on the degrees, ``validation.seq_len`` on the training one, and ``model.hf_assets_path`` as
the Hugging Face weights' folder.
"""

from __future__ import annotations

import logging
from typing import Any

from torchtitan.config.compat.keys_2025 import DEFAULTS, QWEN3_MOE_FLAVORS, RULES, file_is_2025
from torchtitan.config.compat.spellings import Deferred, Fixed, Given, Inert
from torchtitan.config.errors import ConfigError
from torchtitan.config.schema import JobConfigTree
from torchtitan.config.values import toml_value

logger = logging.getLogger(__name__)


def resolve(config: JobConfigTree, given: Given, *, world_size: int | None, config_file: str | None) -> None:
    """Finish ``config`` (being parsed) from what the sources gave in torchtitan 2025's spellings.

    Raises:
        NotImplementedError: a 2025 setting that is not built here, naming the key and why.
        ConfigError: a 2025 value that cannot be translated, or that contradicts a key given here.
    """
    if given.pending:
        raise next(iter(given.pending.values()))
    for key, value in given.spelled.items():
        rule = RULES[key]
        if isinstance(rule, Fixed) and not rule.accepts(value):
            fix = "remove it" if rule.value is None else f"set {key} = {toml_value(rule.value)} or remove it"
            raise NotImplementedError(f"{key} = {toml_value(value)}: {rule.why}; {fix}")
    _log_inert(given)
    file_2025 = file_is_2025(given.file_keys)
    if file_2025:
        _apply_defaults(config, given, config_file)
        _move_qwen3_moe(config, config_file)
    _resolve_compile(config, given, _value(given, "compile.components", file_2025))
    _resolve_global_batch(config, given, world_size)
    _resolve_pipeline(config, given, file_2025)
    _resolve_validation(config, given, file_2025)
    hf_assets = given.spelled.get("model.hf_assets_path")
    ck = config.checkpoint
    if hf_assets is not None and ck.initial_load_in_hf and not ck.initial_load_path:
        ck.initial_load_path = hf_assets  # upstream reads the Hugging Face weights from hf_assets_path then


def _value(given: Given, key: str, file_2025: bool) -> tuple[Any, bool] | None:
    """(value, whether given) of a deferred key: as given, else upstream's default for a 2025 file, else None."""
    if key in given.spelled:
        return given.spelled[key], True
    rule = RULES[key]
    assert isinstance(rule, Deferred)
    return (rule.default, False) if file_2025 else None


def _shown(key: str, found: tuple[Any, bool]) -> str:
    value, was_given = found
    return f"{key} = {toml_value(value)}" + ("" if was_given else " (torchtitan 2025's default)")


def _set(config: JobConfigTree, key: str, value: Any) -> None:
    section, _, name = key.partition(".")
    setattr(getattr(config, section), name, value)


def _get(config: JobConfigTree, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(config, section), name)


def _apply_defaults(config: JobConfigTree, given: Given, config_file: str | None) -> None:
    applied = []
    for key, value, when in DEFAULTS:
        if key not in given.keys and (when is None or _get(config, when)) and _get(config, key) != value:
            _set(config, key, value)
            applied.append(f"{key} = {toml_value(value)}")
    if applied:
        logger.info(
            "%s is written in torchtitan's 2025 schema: the keys it leaves out take that schema's defaults: %s",
            config_file,
            ", ".join(applied),
        )


def _log_inert(given: Given) -> None:
    """Upstream's keys that act only with a converter refused here (so not named): no effect, as upstream."""
    for key, value in given.spelled.items():
        rule = RULES[key]
        if isinstance(rule, Inert) and value != rule.default:
            logger.warning(
                "%s = %s has no effect without %r in model.converters, as in torchtitan 2025 (that converter is "
                "refused here: %s)",
                key, toml_value(value), rule.converter, rule.why,
            )  # fmt: skip


def _move_qwen3_moe(config: JobConfigTree, config_file: str | None) -> None:
    """Upstream's qwen3 family also holds the Qwen3-MoE flavors; here they are qwen3_moe's."""
    m = config.model
    if m.name == "qwen3" and m.flavor in QWEN3_MOE_FLAVORS:
        logger.info(
            "%s: torchtitan 2025's model.name = 'qwen3', flavor = %r is model.name = 'qwen3_moe', flavor = %r here",
            config_file, m.flavor, QWEN3_MOE_FLAVORS[m.flavor],
        )  # fmt: skip
        m.name, m.flavor = "qwen3_moe", QWEN3_MOE_FLAVORS[m.flavor]


def _resolve_compile(config: JobConfigTree, given: Given, components: tuple[Any, bool] | None) -> None:
    """Upstream compiles what ``compile.components`` names when compile is on: 'model' is ``training.compile``
    (each transformer block), 'loss' is ``training.compile_loss``."""
    if components is None:
        return
    names = components[0]
    unknown = [c for c in names if c not in ("model", "loss")]
    if unknown:
        raise ConfigError(f"{_shown('compile.components', components)}: unknown {unknown}; allowed: 'model', 'loss'")
    t = config.training
    if not t.compile:
        return  # upstream: no effect with compile off
    if not names:
        raise ConfigError('compile.components = [] with compile on compiles nothing; set ["model"] or turn it off')
    loss = "loss" in names
    if "training.compile_loss" in given.keys and t.compile_loss != loss:
        raise ConfigError(
            f"{_shown('compile.components', components)} with compile on means training.compile_loss = "
            f"{toml_value(loss)}, but training.compile_loss = {toml_value(t.compile_loss)} is also given; keep only one"
        )
    if "model" not in names:
        logger.info(
            "%s with compile on: the loss is compiled, the blocks are not", _shown("compile.components", components)
        )
    t.compile, t.compile_loss = "model" in names, loss


def _dp_degree(config: JobConfigTree, world_size: int | None) -> int | None:
    """dp_replicate x dp_shard, with dp_shard = -1 inferred as ParallelDims does; None where it cannot be."""
    t, e = config.training, config.experimental
    if t.data_parallel_shard_degree != -1:
        return t.data_parallel_replicate_degree * t.data_parallel_shard_degree
    others = t.data_parallel_replicate_degree * t.tensor_parallel_degree
    others *= e.context_parallel_degree * e.pipeline_parallel_degree
    if world_size is None or others < 1 or world_size % others:
        return None  # no world size given, or degrees that do not fit it (ParallelDims refuses those)
    return t.data_parallel_replicate_degree * (world_size // others)


def _resolve_global_batch(config: JobConfigTree, given: Given, world_size: int | None) -> None:
    """Upstream's rule: gradient accumulation steps = global batch / (local batch x data-parallel degree)."""
    if "training.global_batch_size" not in given.spelled:
        return
    t, key = config.training, "training.global_batch_size"
    global_batch = given.spelled[key]
    if global_batch == -1:
        steps = 1  # upstream's default: local batch x data-parallel degree
    elif global_batch < 1:
        raise ConfigError(f"{key} must be -1 (local_batch_size x data-parallel degree) or >= 1, got {global_batch}")
    else:
        dp = _dp_degree(config, world_size)
        if dp is None:
            if world_size is not None:
                return  # the degrees do not fit the world size: the pre-launch check says so
            raise ConfigError(
                f"{key} = {global_batch} with data_parallel_shard_degree = -1 needs the world size to find the "
                f"data-parallel degree; set parallelism.data_parallel_shard_degree, or gradient_accumulation_steps"
            )
        per_step = t.batch_size * dp
        if global_batch % per_step:
            raise ConfigError(
                f"{key} = {global_batch} is not a multiple of training.local_batch_size ({t.batch_size}) x "
                f"data-parallel degree ({dp}) = {per_step}; set a multiple of {per_step}, or -1 for one micro-batch"
            )
        steps = global_batch // per_step
    if "training.gradient_accumulation_steps" in given.keys and t.gradient_accumulation_steps != steps:
        raise ConfigError(
            f"{key} = {global_batch} means gradient_accumulation_steps = {steps} here, but "
            f"training.gradient_accumulation_steps = {t.gradient_accumulation_steps} is also given; keep only one"
        )
    t.gradient_accumulation_steps = steps


def _resolve_pipeline(config: JobConfigTree, given: Given, file_2025: bool) -> None:
    e, t = config.experimental, config.training
    if e.pipeline_parallel_degree <= 1:
        return
    size = _value(given, "parallelism.pipeline_parallel_microbatch_size", file_2025)
    if size is not None:
        shown = _shown("parallelism.pipeline_parallel_microbatch_size", size)
        if size[0] < 1 or t.batch_size % size[0]:
            raise ConfigError(f"{shown} must divide training.local_batch_size ({t.batch_size})")
        n = t.batch_size // size[0]
        if "experimental.pipeline_parallel_microbatches" in given.keys and e.pipeline_parallel_microbatches != n:
            raise ConfigError(
                f"{shown} means {n} micro-batches of local_batch_size {t.batch_size}, but "
                f"experimental.pipeline_parallel_microbatches = {e.pipeline_parallel_microbatches}; keep only one"
            )
        e.pipeline_parallel_microbatches = n
    for which in ("first", "last"):
        key = f"parallelism.pipeline_parallel_{which}_stage_less_layers"
        less = _value(given, key, file_2025)
        if less is not None and less[0] != 0 and not e.pipeline_parallel_split_points:
            raise NotImplementedError(
                f"{_shown(key, less)}: a {which} stage with fewer layers is not built (without split points the "
                f"layers are split evenly); set both ..._stage_less_layers = 0, or give the split points"
            )
    overlap = _value(given, "parallelism.pipeline_parallel_expert_parallel_overlap", file_2025)
    if overlap and overlap[0] and e.pipeline_parallel_schedule == "DualPipeV" and e.expert_parallel_degree > 1:
        raise NotImplementedError(
            f"{_shown('parallelism.pipeline_parallel_expert_parallel_overlap', overlap)} with DualPipeV and expert "
            f"parallel: overlapping their communication is not built; set it to false"
        )


def _resolve_validation(config: JobConfigTree, given: Given, file_2025: bool) -> None:
    v, t = config.validation, config.training
    if not v.enabled:
        return
    seq_len = _value(given, "validation.seq_len", file_2025)
    if seq_len is not None and seq_len[0] != t.seq_len:
        raise NotImplementedError(
            f"{_shown('validation.seq_len', seq_len)} differs from training.seq_len = {t.seq_len}: validation here "
            f"runs at training.seq_len; set validation.seq_len = {t.seq_len}"
        )
    if file_2025 and "validation.steps" not in given.keys:
        raise NotImplementedError(
            "validation.steps = -1 (torchtitan 2025's default: the whole validation set) is not built; set "
            "validation.steps to a number of batches"
        )
