#!/usr/bin/env bash
# Train with torchrun on this machine.
#   NGPU         processes to start (default: number of GPUs, or 2 on a machine without one)
#   LOG_RANK     ranks whose output is shown, comma-separated (default 0)
#   CONFIG_FILE  TOML config (default ./train_configs/debug_model.toml)
#   PREFLIGHT    1 (default): check the config in one process before starting NGPU; 0 skips that
#                (every rank checks it again anyway; the test matrix saves a torch import per run)
# Any further arguments are config overrides, e.g. --training.steps 20 --training.batch_size=4
set -eu -o pipefail

if [ -z "${NGPU:-}" ]; then
  NGPU=$( (nvidia-smi -L 2>/dev/null || true) | grep -c "^GPU" || true)
  [ "$NGPU" -gt 0 ] || NGPU=2
fi
LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}
PYTHON=${PYTHON:-python3}

for arg in "$@"; do
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
    exec "$PYTHON" -m torchtitan.train --help
  fi
done

# Check the config in one process first: a bad key or layout is one clear line, not N tracebacks.
if [ "${PREFLIGHT:-1}" != "0" ]; then
  "$PYTHON" -m torchtitan.config --world_size "$NGPU" --job.config_file "$CONFIG_FILE" "$@"
fi

exec "$PYTHON" -m torch.distributed.run \
  --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@"
