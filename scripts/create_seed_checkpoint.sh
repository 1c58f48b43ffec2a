#!/usr/bin/env bash
# Initialise the model in one process and save it as step-0 of the checkpoint folder, then exit.
# Later runs (any parallel layout) with checkpoint.enable_checkpoint = true load these weights.
#   CONFIG_FILE  TOML config (default ./train_configs/debug_model.toml)
# Further arguments are config overrides, e.g. --job.dump_folder ./outputs/run1
set -eu -o pipefail

CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}
PYTHON=${PYTHON:-python3}

# One process: every parallel degree 1, whatever the config says.
exec "$PYTHON" -m torchtitan.train --job.config_file "$CONFIG_FILE" \
  --checkpoint.enable_checkpoint --checkpoint.create_seed_checkpoint \
  --training.data_parallel_shard_degree 1 --training.tensor_parallel_degree 1 \
  --experimental.pipeline_parallel_degree 1 --experimental.context_parallel_degree 1 \
  --training.data_parallel_replicate_degree 1 "$@"
