#!/usr/bin/env bash
# Fault tolerance on one machine (docs/fault_tolerance.md): a torchft lighthouse and REPLICA_GROUPS replica groups of
# NGPU ranks each, every group an ordinary ./run_llama_train.sh launch; replica group KILL_GROUP is SIGKILLed
# (its whole process group) once it has logged step KILL_STEP, then restarted with the same command: it heals
# from a live group while the others train on, and all of them finish at the last step.
#   REPLICA_GROUPS      replica groups (default 2)
#   NGPU        ranks per group (default 1; FSDP inside a group with more)
#   KILL_GROUP  the group to kill and restart (default 1; -1 kills none)
#   KILL_STEP   kill it once it has logged this step or a later one (metrics.log_freq decides which it logs;
#               default 10)
#   PORT        the lighthouse's port on 127.0.0.1 (default 29510)
#   DUMP        the job's dump folder (default ./outputs/ft_local); each group's console goes to
#               $DUMP/replica_<i>.log (a restart appends), its metrics to $DUMP/replica_<i>/metrics.jsonl
#   CONFIG_FILE as for run_llama_train.sh (default ./train_configs/debug_model.toml)
# Further arguments are config overrides for every group (default: --training.steps 60).
# Each group gets OMP_NUM_THREADS = cores / all ranks (unless set): groups that share one machine's cores
# would otherwise each spin a thread per core and slow each other down many times over.
set -eu -o pipefail
cd "$(dirname "$0")/.."

REPLICA_GROUPS=${REPLICA_GROUPS:-2}
NGPU=${NGPU:-1}
KILL_GROUP=${KILL_GROUP:-1}
KILL_STEP=${KILL_STEP:-10}
PORT=${PORT:-29510}
DUMP=${DUMP:-./outputs/ft_local}
PYTHON=${PYTHON:-python3}
for name in REPLICA_GROUPS NGPU KILL_STEP PORT; do
  if ! [[ "${!name}" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: $name = '${!name}': must be a positive integer" >&2
    exit 2
  fi
done
if ! [[ "$KILL_GROUP" =~ ^-?[0-9]+$ ]] || [ "$KILL_GROUP" -ge "$REPLICA_GROUPS" ]; then
  echo "error: KILL_GROUP = '$KILL_GROUP': must be -1 (none) or a group 0..$((REPLICA_GROUPS - 1))" >&2
  exit 2
fi
LIGHTHOUSE_BIN=$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")/torchft_lighthouse
[ -x "$LIGHTHOUSE_BIN" ] || LIGHTHOUSE_BIN=$(command -v torchft_lighthouse || true)
if [ -z "$LIGHTHOUSE_BIN" ]; then
  echo 'error: torchft_lighthouse not found: install the fault-tolerance extra, pip install -e ".[ft]"' >&2
  exit 2
fi
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--training.steps 60)
THREADS=$(( $(nproc) / (REPLICA_GROUPS * NGPU) ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( THREADS > 0 ? THREADS : 1 ))}
export TORCHFT_LIGHTHOUSE="http://127.0.0.1:$PORT"
mkdir -p "$DUMP"

PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -9 -- "-$pid" 2>/dev/null || true; done
  [ -z "${LIGHTHOUSE_PID:-}" ] || kill "$LIGHTHOUSE_PID" 2>/dev/null || true
}
trap cleanup EXIT

# The lighthouse forms a quorum of whichever groups are up; a group silent for 2 s is dropped from it.
"$LIGHTHOUSE_BIN" --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 --heartbeat_timeout_ms 2000 \
  --bind "127.0.0.1:$PORT" > "$DUMP/lighthouse.log" 2>&1 &
LIGHTHOUSE_PID=$!
echo "lighthouse at $TORCHFT_LIGHTHOUSE (pid $LIGHTHOUSE_PID, log $DUMP/lighthouse.log)"

start_group() {  # a replica group in its own process group (setsid), so a SIGKILL reaches every rank
  setsid env NGPU="$NGPU" ./run_llama_train.sh --job.dump_folder "$DUMP" --fault_tolerance.enable \
    --fault_tolerance.group_size "$REPLICA_GROUPS" --fault_tolerance.replica_id "$1" "${ARGS[@]}" \
    >> "$DUMP/replica_$1.log" 2>&1 &
  PIDS[$1]=$!
  echo "replica group $1: pid $! (log $DUMP/replica_$1.log)"
}
for ((i = 0; i < REPLICA_GROUPS; i++)); do
  : > "$DUMP/replica_$i.log"
  start_group "$i"
done

if [ "$KILL_GROUP" -ge 0 ]; then
  metrics="$DUMP/replica_$KILL_GROUP/metrics.jsonl"
  logged() { tail -n 1 "$metrics" 2>/dev/null | sed -nE 's/^\{"step": ([0-9]+),.*/\1/p'; }
  until [ "$(logged)" -ge "$KILL_STEP" ] 2>/dev/null; do
    if ! kill -0 "${PIDS[$KILL_GROUP]}" 2>/dev/null; then
      echo "replica group $KILL_GROUP ended before step $KILL_STEP; see $DUMP/replica_$KILL_GROUP.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  echo "killing replica group $KILL_GROUP after step $(logged) (SIGKILL to its process group)"
  kill -9 -- "-${PIDS[$KILL_GROUP]}"
  wait "${PIDS[$KILL_GROUP]}" 2>/dev/null || true
  echo "restarting replica group $KILL_GROUP with the same command"
  start_group "$KILL_GROUP"
fi

status=0
for ((i = 0; i < REPLICA_GROUPS; i++)); do
  wait "${PIDS[$i]}" || { echo "replica group $i exited with $?" >&2; status=1; }
done
PIDS=()
echo
for ((i = 0; i < REPLICA_GROUPS; i++)); do
  echo "--- replica group $i: its fault-tolerance lines"
  grep -h "fault tolerance" "$DUMP/replica_$i.log" | sed 's/^\[rank0\]://'
done
exit "$status"
