"""Memory- and precision-saving options through the trainer on the debug model (1 process, the shipped corpus).

bf16 optimizer states: 50 steps with exp_avg / exp_avg_sq in bfloat16 against fp32 states, same
seed and data. The update math is fp32 in both; only the stored moments are rounded (to 8 bits of
mantissa), and the difference compounds through 50 updates on real text. Measured on this machine:
max relative per-step loss gap 1.2e-2 (step 32), mean 1.4e-3, final 2.5e-4, while the loss falls
8.18 -> 5.67. Tolerances: max 3e-2, mean 5e-3, final 3e-3. (The optimizer's math itself is checked
exactly against torch's AdamW with fp32 states in tests/unit/test_optimizer.py, which also measures
the state's bytes on the debug model's parameters: exactly half.)

float8 linears (torchao, tensorwise and rowwise): the same 50 steps against the same fp32 run (its
fp32-state baseline is shared). Baseline: fp32, not bf16 autocast, because bf16 runs ~8x slower on
this CPU (462 s for these 50 steps, against ~60 s); bf16 itself moves these losses by <= 2e-4 over 6
steps (tests/integration_tests.py BF16_ROWS), far below float8's gaps. Measured: see FLOAT8_CURVE.
float8 on CPU is slower than fp32 (no float8 GEMM units; measured 548 tokens/s tensorwise and 305
rowwise against 1535 for fp32 here): these two runs are the costliest float8 tests.
"""

from __future__ import annotations

import pytest

from tests.integration_tests import read_metrics, train

pytestmark = [pytest.mark.integration, pytest.mark.pool(1)]

STEPS = 50
ARGS = [
    # the debug flavor (run_train's COMMON names the matrix's tiny one): the measured curves below are its
    "--model.flavor",
    "debugmodel",
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "64",
    "--training.batch_size",
    "8",
    "--training.warmup_steps",
    "5",
    "--training.seed",
    "42",
    "--training.deterministic",
    "--metrics.log_freq",
    "1",
    "--optimizer.lr",
    "3e-3",
    "--training.mixed_precision_param",
    "float32",
]


def _losses(tmp_path, name: str, args: list[str]) -> list[float]:
    folder = str(tmp_path / name)
    result = train(1, folder, [*ARGS, *args])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(folder) if "loss" in r]
    assert len(losses) == STEPS
    return losses


@pytest.fixture(scope="module")
def fp32(tmp_path_factory) -> list[float]:
    return _losses(tmp_path_factory.mktemp("fp32"), "fp32", ["--optimizer.state_dtype", "float32"])


def test_bf16_states_track_fp32_states_over_50_steps(tmp_path, fp32):
    bf16 = _losses(tmp_path, "bf16", ["--optimizer.state_dtype", "bfloat16"])
    gaps = [abs(a - b) / a for a, b in zip(fp32, bf16)]
    print(
        f"\n50 steps: fp32 states {fp32[0]:.3f} -> {fp32[-1]:.3f}, bf16 states -> {bf16[-1]:.3f}; relative gap "
        f"max {max(gaps):.2e} (step {gaps.index(max(gaps)) + 1}), mean {sum(gaps) / len(gaps):.2e}, final {gaps[-1]:.2e}"
    )
    assert fp32[0] - fp32[-1] > 2.0 and bf16[0] - bf16[-1] > 2.0, (fp32, bf16)
    assert max(gaps) < 3e-2 and sum(gaps) / len(gaps) < 5e-3 and gaps[-1] < 3e-3, gaps


# recipe -> limits on the (max, mean, final) relative loss gap to the fp32 run. Measured on an Intel Xeon
# with AMX (loss 8.18 -> 5.67): tensorwise 1.96e-2 (step 14, a loss spike both runs take), 2.46e-3,
# 2.00e-3; rowwise 3.23e-2 (step 14), 2.54e-3, 3.33e-3. On an AMD EPYC (no AMX; the CI machine since
# 2026-11) the fp32 curve is the same to 4 digits and torch._scaled_mm equals an fp32 matmul of the
# dequantized operands within 3e-7, but tensorwise takes the spike at steps 11-15 on another branch
# (gap 7e-4 at most up to step 10, 4.2e-2 at step 15) and stays ~1.5 % above fp32: 4.23e-2, 1.37e-2,
# 1.49e-2 (rowwise 1.0e-2, 3.0e-3, 3.5e-3). Limits ~2x the larger of the two machines' measurements; a
# run without float8 fails the last check (mean gap > 1e-5), the float8 math itself is tests/unit/test_float8.py.
FLOAT8_CURVE = {"tensorwise": (8e-2, 3e-2, 3e-2), "rowwise": (6e-2, 7.5e-3, 1e-2)}


@pytest.mark.parametrize("recipe", list(FLOAT8_CURVE))
def test_float8_tracks_fp32_over_50_steps(recipe: str, tmp_path, fp32):
    f8 = _losses(tmp_path, recipe, ["--float8.enable_float8_linear", "--float8.recipe_name", recipe])
    gaps = [abs(a - b) / a for a, b in zip(fp32, f8)]
    worst, mean, final = max(gaps), sum(gaps) / len(gaps), gaps[-1]
    print(
        f"\n50 steps: fp32 {fp32[0]:.3f} -> {fp32[-1]:.3f}, float8 {recipe} -> {f8[-1]:.3f}; relative gap max "
        f"{worst:.2e} (step {gaps.index(worst) + 1}), mean {mean:.2e}, final {final:.2e}"
    )
    assert f8[0] - f8[-1] > 2.0, f8
    limits = FLOAT8_CURVE[recipe]
    assert worst < limits[0] and mean < limits[1] and final < limits[2], gaps
    assert mean > 1e-5, "float8 rounding does not show: not float8?"
