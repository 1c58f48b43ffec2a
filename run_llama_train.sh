#!/usr/bin/env bash
# Train with torchrun on this machine, through our launcher (python -m torchtitan.launch, torchrun's
# arguments): a rank's error is printed once, with its rank, whichever ranks LOG_RANK shows.
#   NGPU         processes to start (default: number of GPUs, or 2 on a machine without one)
#   LOG_RANK     ranks whose output is shown, comma-separated (default 0)
#   CONFIG_FILE  TOML config (default ./train_configs/debug_model.toml); a --job.config_file argument
#                wins over it (one line says so when both are given and differ)
#   MODULE, CONFIG  instead of a TOML: function CONFIG of module MODULE returns the config (as --module M --config F,
#                which win over them); not with CONFIG_FILE (pick one)
#   PREFLIGHT    1 (default): check the config once, in the launcher's process, before starting NGPU; 0 skips that
#                (every rank checks it again anyway)
# Any further arguments are config overrides, e.g. --training.steps 20 --training.batch_size=4
# Exit code: 0 done, 1 a crash (its traceback shown once), 2 a user error (one line); docs/reliability.md.
set -eu -o pipefail

if [ -z "${NGPU:-}" ]; then
  NGPU=$( (nvidia-smi -L 2>/dev/null || true) | grep -c "^GPU" || true)
  [ "$NGPU" -gt 0 ] || NGPU=2
fi
LOG_RANK=${LOG_RANK:-0}
PYTHON=${PYTHON:-python3}

if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NGPU = '$NGPU': the number of processes to start must be a positive integer, e.g. NGPU=2" >&2
  exit 2
fi
if ! [[ "$LOG_RANK" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "error: LOG_RANK = '$LOG_RANK': must be comma-separated ranks, e.g. LOG_RANK=0 or LOG_RANK=0,1" >&2
  exit 2
fi
for rank in ${LOG_RANK//,/ }; do
  if [ "$rank" -ge "$NGPU" ]; then
    echo "error: LOG_RANK = '$LOG_RANK': rank $rank does not exist with NGPU = $NGPU (ranks 0..$((NGPU - 1)))" >&2
    exit 2
  fi
done

for arg in "$@"; do
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
    exec "$PYTHON" -m torchtitan.train --help
  fi
done

# The config: the user's --job.config_file, else --module/--config or MODULE/CONFIG, else CONFIG_FILE, else the
# debug model's TOML.
source "$(dirname "$0")/scripts/config_args.sh"
config_args ./train_configs/debug_model.toml "$@"

# The config checked first, in the launcher's process (python -m torchtitan.preflight's check): a bad key or layout is
# one clear line, not N tracebacks.
LAUNCHER=torchtitan.preflight_launch
if [ "${PREFLIGHT:-1}" = "0" ]; then
  LAUNCHER=torchtitan.launch
fi

exec "$PYTHON" -m "$LAUNCHER" \
  --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m torchtitan.train "${CONFIG_ARGS[@]}" "$@"
