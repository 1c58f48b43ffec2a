#!/usr/bin/env bash
# Fault tolerance on one machine (docs/fault_tolerance.md): a torchft lighthouse and REPLICA_GROUPS replica groups of
# NGPU ranks each, every group an ordinary ./run_llama_train.sh launch; replica group KILL_GROUP is SIGKILLed
# (its whole process group) once it has logged step KILL_STEP, then restarted with the same command: it heals
# from a live group while the others train on, and all of them finish at the last step on the same weights.
# The other groups are paused while a group starts, dies and restarts (no race with wall time on a busy machine);
# at the end the script checks its claims and exits 1 with one line naming the first that failed.
#   REPLICA_GROUPS      replica groups (default 2)
#   NGPU        ranks per group (default 1; FSDP inside a group with more)
#   KILL_GROUP  the group to kill and restart (default 1; -1 kills none)
#   KILL_STEP   kill it once it has logged this step or a later one (metrics.log_freq decides which it logs;
#               default 10; refused when it leaves the survivors under 8 + log_freq - 1 steps to hold back)
#   PORT        the lighthouse's port on 127.0.0.1 (default 29510)
#   DUMP        the job's dump folder (default ./outputs/ft_local): an earlier job's files there move to
#               $DUMP/earlier_runs/<when>/; each group's console goes to $DUMP/replica_<i>.log (a restart
#               appends), its metrics to $DUMP/replica_<i>/metrics.jsonl, what the job did to $DUMP/ft_local.json
#   CONFIG_FILE as for run_llama_train.sh (default ./train_configs/debug_model.toml)
#   PYTHON      the interpreter (default python3)
# Further arguments are config overrides for every group (default: --training.steps 60).
# scripts/ft_local.sh --check DUMP checks a finished job's claims again without running anything.
# Each group gets OMP_NUM_THREADS = cores / all ranks (unless set). The job itself: scripts/ft_local.py.
set -eu -o pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/ft_local.py "$@"
