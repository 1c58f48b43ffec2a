#!/usr/bin/env bash
# Check this checkout against torch releases (docs/testing.md, "Torch releases"). Per VERSION: a scratch venv
# with torch==VERSION, then this package with its dev extra (which must keep that torch), then the unit suite
# and the smoke subset below; one summary line per version. Exit 1 if any version failed.
#
#   scripts/check_torch_versions.sh [VERSION ...]    default: 2.11.0 (the oldest supported) and the newest
#                                                    torch on the registry
#   VENV_ROOT  where the venvs and logs live (default /tmp/torchtitan-torch-versions); a venv that already
#              holds VERSION is reused, so a rerun only tests
#   PYTHON     the interpreter the venvs are made from (default python3)
#
# The registry's Linux wheels are CUDA builds (about 3 GB each with their nvidia-* dependencies); they run on
# CPU. Versions run one after the other: the suites are sized for a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV_ROOT=${VENV_ROOT:-/tmp/torchtitan-torch-versions}

# The smoke subset (pytest node ids): the default run, the FSDP2 / TP2 / PP2 / CP2 parity rows (CP2 with our
# ring and with torch's, whose private names are the likeliest to move), checkpoint resume (TP2, PP2, CP2,
# MoE EP2, each also resharded), the Hugging Face export, and the estimator.
SMOKE=(
  tests/runs/training/test_golden_loss.py
  "tests/runs/training/test_parity_matrix.py::test_loss_parity[fsdp2]"
  "tests/runs/training/test_parity_matrix.py::test_loss_parity[tp2]"
  "tests/runs/training/test_parity_matrix.py::test_loss_parity[pp2_1f1b]"
  "tests/runs/training/test_parity_matrix.py::test_loss_parity[cp2_allgather]"
  "tests/runs/training/test_parity_matrix.py::test_loss_parity[cp2_torch]"
  tests/runs/checkpoint/test_checkpoint_runs.py::test_resume_same_layout_is_bit_exact
  "tests/runs/models/test_shipped_configs.py::test_shipped_config_trains_and_exports_with_our_logits[debug_model]"
  tests/runs/estimation/test_estimation.py::test_depth_extrapolation_equals_the_full_depth_run
)

# This machine's pip configuration may cap torch with a constraints file; PIP_CONSTRAINT=/dev/null lifts it for
# these installs (an empty PIP_CONSTRAINT does not: pip then keeps the configured file). The package is installed
# with nothing holding torch, so the check after it is the acceptance check: `pip install -e .` keeps the torch the
# environment has. Only a dev requirement installed one by one (after `.[dev]` failed to resolve) is held to this
# torch by a constraints file, so it fails instead of moving torch. (Called from an `if`, where bash ignores
# `set -e`: every step checks its own status.)
install() {
  local version=$1 venv=$2 log=$3
  if [[ -x $venv/bin/python ]] && "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
    echo "reusing $venv (torch $version)" >>"$log"
  else
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv" || return 1
  fi
  local pip=(env PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install --disable-pip-version-check)
  "${pip[@]}" "torch==$version" >>"$log" 2>&1 || return 1
  if ! "${pip[@]}" -e ".[dev]" >>"$log" 2>&1; then
    # a dev requirement that cannot install next to this torch: install the rest; its feature refuses in one line
    "${pip[@]}" -e . >>"$log" 2>&1 || return 1
    echo "torch==$version" >"$venv/constraints.txt"
    local req
    while read -r req; do
      env "PIP_CONSTRAINT=$venv/constraints.txt" "$venv/bin/python" -m pip install --disable-pip-version-check \
        "$req" >>"$log" 2>&1 || echo "NOT INSTALLED with torch $version: $req" | tee -a "$log"
    done < <("$venv/bin/python" -c "
try:
    import tomllib
except ImportError:  # Python 3.10: the package's own dependency
    import tomli as tomllib
print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['dev']))")
  fi
  local got
  got=$("$venv/bin/python" -c "import torch; print(torch.__version__)") || return 1
  if [[ ${got%%+*} != "$version" ]]; then
    echo "pip install -e . replaced torch $version with $got" | tee -a "$log"
    return 1
  fi
}

# "664 passed, 2 skipped, 1 error in 153.14s" -> "664 passed, 0 failed, 1 error, 2 skipped"
counts() {
  local line
  line=$(grep -E "^=*.*[0-9]+ (passed|failed|error|errors|skipped).* in [0-9.]+s" "$1" | tail -1 || true)
  local passed failed errors skipped
  passed=$(grep -oE "[0-9]+ passed" <<<"$line" | grep -oE "[0-9]+" || echo 0)
  failed=$(grep -oE "[0-9]+ failed" <<<"$line" | grep -oE "[0-9]+" || echo 0)
  errors=$(grep -oE "[0-9]+ errors?" <<<"$line" | grep -oE "[0-9]+" || echo 0)
  skipped=$(grep -oE "[0-9]+ skipped" <<<"$line" | grep -oE "[0-9]+" || echo 0)
  echo "$passed passed, $failed failed, $errors error, $skipped skipped"
}

run_pytest() {
  local venv=$1 log=$2
  shift 2
  local start=$SECONDS status=0
  PATH=$venv/bin:$PATH PYTHON=$venv/bin/python TORCHINDUCTOR_CACHE_DIR=$venv/inductor-cache \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1 || status=$?
  echo "$(counts "$log") ($((SECONDS - start)) s)"
  return $status
}

check_version() {
  local version=$1 venv=$VENV_ROOT/$1 start=$SECONDS ok=0
  mkdir -p "$VENV_ROOT"
  if ! install "$version" "$venv" "$VENV_ROOT/$version-install.log"; then
    echo "torch $version: install failed (see $VENV_ROOT/$version-install.log)"
    return 1
  fi
  local unit smoke
  unit=$(run_pytest "$venv" "$VENV_ROOT/$version-unit.log" tests/unit) || ok=1
  smoke=$(run_pytest "$venv" "$VENV_ROOT/$version-smoke.log" "${SMOKE[@]}") || ok=1
  echo "torch $version: unit $unit; smoke $smoke; $((SECONDS - start)) s with install (logs: $VENV_ROOT/$version-*.log)"
  return $ok
}

if [[ $# -eq 0 ]]; then
  newest=$(PIP_CONSTRAINT=/dev/null "$PYTHON" -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\(.*\))$/\1/p')
  if [[ -z $newest ]]; then
    echo "could not ask the registry for torch's newest release; name the versions: $0 2.11.0 2.15.0" >&2
    exit 2
  fi
  set -- 2.11.0 "$newest"
fi

echo "$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) cores; smoke subset: ${#SMOKE[@]} node ids"
status=0
for version in "$@"; do
  check_version "$version" || status=1
done
exit $status
