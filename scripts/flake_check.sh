#!/usr/bin/env bash
# Run the distributed and integration tests N times and count each test's failures: a flaky test shows as
# "k/N failed" instead of hiding in one red CI run.
#   scripts/flake_check.sh N [pytest args ...]      (default N = 5; extra args narrow the selection, e.g. -k pp2)
# Exit 0 when no test failed in any round, 1 otherwise. Each round's log and JUnit XML stay in $FLAKE_DIR
# (default a fresh temporary folder, printed at the start).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
rounds=${1:-5}
shift || true
if ! [[ "$rounds" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: N = '$rounds': the number of rounds must be a positive integer, e.g. scripts/flake_check.sh 5" >&2
  exit 2
fi
out=${FLAKE_DIR:-$(mktemp -d /tmp/flake_check.XXXXXX)}
mkdir -p "$out"
echo "flake_check: $rounds round(s) of tests/distributed and tests/runs/training/test_parity_matrix.py; logs in $out"
for round in $(seq 1 "$rounds"); do
  start=$(date +%s)
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/distributed tests/runs/training/test_parity_matrix.py \
    --junitxml="$out/round$round.xml" "$@" >"$out/round$round.log" 2>&1 || true
  echo "round $round/$rounds: $(tail -n 1 "$out/round$round.log") ($(($(date +%s) - start)) s)"
done
"$PYTHON" - "$out" "$rounds" <<'PY'
import glob
import sys
import xml.etree.ElementTree as ET
from collections import Counter

folder, rounds = sys.argv[1], int(sys.argv[2])
runs, failed = Counter(), Counter()
for path in sorted(glob.glob(f"{folder}/round*.xml")):
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        runs[name] += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed[name] += 1
missing = rounds - len(glob.glob(f"{folder}/round*.xml"))
for name, count in failed.most_common():
    print(f"{count}/{runs[name]} failed  {name}")
print(f"flake_check: {len(runs)} tests x {rounds} rounds: {sum(failed.values())} failures in {len(failed)} tests"
      + (f"; {missing} round(s) wrote no report" if missing else ""))
sys.exit(1 if failed or missing else 0)
PY
