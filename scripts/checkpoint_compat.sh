#!/usr/bin/env bash
# Save at commit A, resume at commit B (docs/checkpoint.md, "Compatibility"): both commits are checked out in
# temporary git worktrees; A trains STEPS steps and saves at SAVE_STEP and at the end; B resumes from A's
# SAVE_STEP checkpoint in a fresh folder and trains to STEPS. B's losses after SAVE_STEP must equal A's bit for
# bit (the same machine, the same interpreter); the script prints both and exits 1 with one line if they differ.
#   scripts/checkpoint_compat.sh A B [config overrides for both runs...]
#   NGPU        ranks of A's run (default 1)
#   NGPU_B      ranks of B's run (default NGPU): another layout resumes within rounding, not bit for bit
#   STEPS, SAVE_STEP   default 6 and 3
#   CONFIG_FILE as for run_llama_train.sh (default ./train_configs/debug_model.toml, at each commit)
#   PYTHON      the interpreter (default python3); each run imports torchtitan from its own worktree
#   KEEP        1: keep the worktrees and runs (printed) instead of removing them
set -eu -o pipefail
if [ $# -lt 2 ]; then
  echo "usage: scripts/checkpoint_compat.sh A B [config overrides...] (A, B: commits, tags or branches)" >&2
  exit 2
fi
A=$1 B=$2
shift 2
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
NGPU=${NGPU:-1}
NGPU_B=${NGPU_B:-$NGPU}
STEPS=${STEPS:-6}
SAVE_STEP=${SAVE_STEP:-3}
for rev in "$A" "$B"; do
  git rev-parse --verify --quiet "$rev^{commit}" >/dev/null || { echo "checkpoint_compat: $rev is not a commit here" >&2; exit 2; }
done
work=$(mktemp -d "${TMPDIR:-/tmp}/checkpoint_compat.XXXXXX")
cleanup() {
  if [ "${KEEP:-0}" = 1 ]; then
    echo "checkpoint_compat: kept $work" >&2
  else
    git worktree remove --force "$work/a" 2>/dev/null || true
    git worktree remove --force "$work/b" 2>/dev/null || true
    rm -rf "$work"
  fi
}
trap cleanup EXIT
git worktree add --quiet --detach "$work/a" "$A"
git worktree add --quiet --detach "$work/b" "$B"

ARGS=(--training.steps "$STEPS" --checkpoint.enable_checkpoint --checkpoint.interval "$SAVE_STEP"
  --training.seed 42 --training.deterministic --metrics.log_freq 1 "$@")
run() { # run <worktree> <ngpu> <dump folder> <log>
  (cd "$1" && PYTHON="$PYTHON" NGPU="$2" ./run_llama_train.sh "${ARGS[@]}" --job.dump_folder "$3" >"$4" 2>&1) || {
    echo "checkpoint_compat: the run at $(git -C "$1" rev-parse --short HEAD) failed; its log: $4 (KEEP=1 keeps it)" >&2
    tail -5 "$4" >&2
    exit 1
  }
}
run "$work/a" "$NGPU" "$work/run_a" "$work/a.log"
mkdir -p "$work/run_b/checkpoint"
cp -r "$work/run_a/checkpoint/step-$SAVE_STEP" "$work/run_b/checkpoint/"
run "$work/b" "$NGPU_B" "$work/run_b" "$work/b.log"
grep -q "resumed from step $SAVE_STEP" "$work/b.log" || {
  echo "checkpoint_compat: the run at $B did not resume from step $SAVE_STEP; see $work/b.log (KEEP=1 keeps it)" >&2
  exit 1
}
"$PYTHON" - "$work/run_a/metrics.jsonl" "$work/run_b/metrics.jsonl" "$SAVE_STEP" "$A" "$B" <<'EOF'
import json, sys

def losses(path):
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r and r["step"] > int(sys.argv[3])}

a, b = losses(sys.argv[1]), losses(sys.argv[2])
for step in sorted(a):
    print(f"step {step}: {sys.argv[4]} {a[step]!r}  {sys.argv[5]} {b.get(step)!r}")
if a != b or not a:
    sys.exit(f"checkpoint_compat: {sys.argv[5]} resumed from {sys.argv[4]}'s step-{sys.argv[3]} with other losses")
print(f"checkpoint_compat: {sys.argv[5]} resumes {sys.argv[4]}'s checkpoint bit for bit")
EOF
