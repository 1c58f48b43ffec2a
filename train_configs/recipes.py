"""Configurations as code: each function returns a run's whole config, checked as a TOML file's values are.

    ./run_llama_train.sh --module train_configs.recipes --config debug_model --training.steps 10
    MODULE=train_configs.recipes CONFIG=debug_model ./run_llama_train.sh      # the same, as upstream's launcher reads it

Flags still apply on top (and win); the run's config.toml holds the resolved values (docs/compatibility.md,
"Configurations as code").
"""

from torchtitan.config import JobConfig


def debug_model() -> JobConfig:
    """train_configs/debug_model.toml as code: the debug llama, 30 steps, FSDP over every rank, fp32 on CPU."""
    config = JobConfig()
    config.job.dump_folder = "./outputs/debug_model"
    config.job.description = "Llama 3 debug training"
    config.job.use_for_integration_test = True
    config.profiling.save_traces_folder = "profile_trace"
    config.metrics.log_freq = 5
    config.model.flavor = "debugmodel"
    config.optimizer.lr = 8e-4
    t = config.training
    t.dataset, t.batch_size, t.seq_len, t.warmup_steps, t.steps, t.seed = "pydocs", 8, 256, 5, 30, 0
    t.mixed_precision_param = "float32"  # fp32 on CPU keeps runs comparable bit-for-bit with 1 process
    config.checkpoint.interval = 5  # steps, with --checkpoint.enable_checkpoint
    config.activation_checkpoint.mode = "none"
    return config


def debug_model_long() -> JobConfig:
    """A variation is a function of another: the debug model for 200 steps, checkpointed every 50."""
    config = debug_model()
    config.job.dump_folder = "./outputs/debug_model_long"
    config.training.steps = 200
    config.checkpoint.enable_checkpoint = True
    config.checkpoint.interval = 50
    return config
