"""Upstream torchtitan 2026's names that its recipe modules import, as stand-ins (``MODULES``: module -> names).

The registry functions return what upstream's return (torchtitan/models/*/config_registry.py at b5bcd76c6), in
the stand-in classes of ``classes``: the same field values, the model as (family, flavor, attention backend,
converters), the loss and the data as records. Only the functions upstream's ``features`` suite uses are here; a
recipe importing another upstream name gets one line naming it (``__init__.describe_missing``).
"""

from __future__ import annotations

from typing import Any

import torchtitan.config.compat.upstream_2026.classes as c


class Trainer:
    Config = c.TrainerConfig


class ActivationCheckpointing:
    Config = c.ActivationCheckpointConfig


class FullAC:
    Config = c.FullACConfig


class SelectiveAC:
    Config = c.SelectiveACConfig


class MemoryBudgetAC:
    Config = c.MemoryBudgetACConfig


def _adamw(lr: float) -> c.OptimizerConfig:
    """upstream's ``default_adamw(lr)``: one AdamW group over every parameter."""
    kwargs = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    return c.OptimizerConfig(
        param_groups=[c.ParamGroup(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs=kwargs)]
    )


def _debug_schedule() -> c.LRSchedulerConfig:
    return c.LRSchedulerConfig(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0)


def _debug_training() -> c.TrainingConfig:
    return c.TrainingConfig(num_tokens_per_microbatch_per_dp_rank=8 * 2048, max_context_length=2048, steps=10)


def llama3_debugmodel() -> c.TrainerConfig:
    packed = c.Data(dataset="c4_test", shuffle=False)
    return c.TrainerConfig(
        loss=c.Loss(chunked=True),
        hf_assets_path="./tests/assets/tokenizer",
        model_spec=c.ModelSpec(name="llama3", flavor="debugmodel"),
        optimizer=_adamw(8e-4),
        lr_scheduler=_debug_schedule(),
        training=_debug_training(),
        dataloader=packed,
        metrics=c.MetricsConfig(log_freq=1),
        parallelism=c.ParallelismConfig(pipeline_parallel_schedule="Interleaved1F1B"),
        checkpoint=c.CheckpointConfig(interval=10, last_save_model_only=False),
        activation_checkpoint=c.SelectiveACConfig(),
        validator=c.ValidatorConfig(freq=5, steps=10, dataloader=c.Data(dataset="c4_test", shuffle=False)),
    )


def llama3_debugmodel_varlen_attn() -> c.TrainerConfig:
    config = llama3_debugmodel()
    config.model_spec = c.ModelSpec(name="llama3", flavor="debugmodel", attn_backend="varlen")
    config.training.disable_cuda_graphs = True
    return config


def llama3_debugmodel_ce_loss() -> c.TrainerConfig:
    config = llama3_debugmodel()
    config.loss = c.Loss(chunked=False)
    return config


def llama3_debugmodel_float8_emulate_lora() -> c.TrainerConfig:
    config = llama3_debugmodel()
    converters = [
        c.Float8Converter(emulate=True, model_compile_enabled=False),
        c.LoRAConverter(rank=8, alpha=16.0, target_modules=["wq", "wkv", "wo"]),
    ]
    config.model_spec = c.ModelSpec(name="llama3", flavor="debugmodel", converters=converters)
    return config


def sft_debugmodel() -> c.TrainerConfig:
    """Upstream's SFT debug run: the llama3 debug model on chat rows (question, answer) of a local json file."""
    return c.TrainerConfig(
        loss=c.Loss(chunked=True),
        hf_assets_path="./tests/assets/tokenizer",
        model_spec=c.ModelSpec(name="llama3", flavor="debugmodel", attn_backend="flex"),
        optimizer=_adamw(8e-4),
        lr_scheduler=_debug_schedule(),
        training=_debug_training(),
        dataloader=c.Data(path="tests/assets/sft_test/data.json", chat=True),
        metrics=c.MetricsConfig(log_freq=1),
        checkpoint=c.CheckpointConfig(interval=10, last_save_model_only=False),
        activation_checkpoint=c.SelectiveACConfig(),
    )


def deepseek_v3_debugmodel() -> c.TrainerConfig:
    return c.TrainerConfig(
        loss=c.Loss(chunked=True),
        hf_assets_path="./tests/assets/tokenizer",
        metrics=c.MetricsConfig(log_freq=1),
        model_spec=c.ModelSpec(name="deepseek_v3", flavor="debugmodel"),
        dataloader=c.Data(dataset="c4_test"),
        optimizer=_adamw(8e-4),
        lr_scheduler=_debug_schedule(),
        training=_debug_training(),
        parallelism=c.ParallelismConfig(expert_parallel_degree=1),
        checkpoint=c.CheckpointConfig(interval=10, last_save_model_only=False),
        activation_checkpoint=c.SelectiveACConfig(),
    )


_AC = {n: globals()[n] for n in ("ActivationCheckpointing", "FullAC", "SelectiveAC", "MemoryBudgetAC")}
MODULES: dict[str, dict[str, Any]] = {
    "torchtitan.trainer": {"Trainer": Trainer},
    "torchtitan.distributed.activation_checkpoint": _AC,
    "torchtitan.models.llama3.config_registry": {
        f.__name__: f
        for f in (
            llama3_debugmodel,
            llama3_debugmodel_varlen_attn,
            llama3_debugmodel_ce_loss,
            llama3_debugmodel_float8_emulate_lora,
            sft_debugmodel,
        )
    },
    "torchtitan.models.deepseek_v3.config_registry": {"deepseek_v3_debugmodel": deepseek_v3_debugmodel},
}
