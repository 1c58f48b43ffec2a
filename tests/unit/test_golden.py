"""The golden-value comparison of the parity matrix (tests/support/golden.py), on values made up here: no training."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from tests.support.golden import Golden, GoldenCheck, load_golden, record, values_of

HERE = "torch 2.13.0+cpu; kernels AVX512; isa avx2 avx512f; 2 threads"
OTHER = "torch 2.13.0+cpu; kernels AVX2; isa avx2; 2 threads"
TOLERANCE = {"loss": 1e-5, "grad_norm": 3e-4, "validation_loss": 1e-5}
LOSSES = {"loss": [8.25, 7.5], "grad_norm": [1.5, 1.25], "validation_loss": [7.75]}


def values(loss_2: float = 7.5) -> dict:
    return values_of({**LOSSES, "loss": [8.25, loss_2]}, val_freq=2)


def test_one_ulp_on_the_recorded_fingerprint_fails():
    check = GoldenCheck(Golden({HERE: {"fsdp2": values()}}), here=HERE)
    check.check("fsdp2", values(), TOLERANCE)
    with pytest.raises(AssertionError, match=r"golden fsdp2: loss at step 2: got 7\.500000000000001, golden 7\.5"):
        check.check("fsdp2", values(math.nextafter(7.5, 8.0)), TOLERANCE)
    assert check.exact == ["fsdp2", "fsdp2"]


def test_another_fingerprint_falls_back_to_the_tolerance_and_says_so_once():
    check = GoldenCheck(Golden({OTHER: {"fsdp2": values(), "tp2": values()}}), here=HERE)
    with pytest.warns(UserWarning, match="exactness was not checked"):
        check.check("fsdp2", values(7.5 * (1 + 5e-6)), TOLERANCE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        check.check("tp2", values(math.nextafter(7.5, 8.0)), TOLERANCE)
    with pytest.raises(AssertionError, match=r"golden tp2: loss at step 2: .* \(compared within relative 1e-05\)"):
        check.check("tp2", values(7.5 * (1 + 2e-5)), TOLERANCE)
    assert check.elsewhere == ["fsdp2", "tp2", "tp2"] and not check.exact
    assert "3 rows within tolerance only" in "\n".join(check.summary())


def test_a_row_in_rtol_rows_is_compared_within_the_tolerance():
    check = GoldenCheck(Golden({HERE: {"fsdp2_compile": values()}}, {"fsdp2_compile": "why"}), here=HERE)
    check.check("fsdp2_compile", values(math.nextafter(7.5, 8.0)), TOLERANCE)
    assert check.tolerance == ["fsdp2_compile"]


def test_a_row_missing_from_the_golden_file_fails_with_how_to_record_it():
    check = GoldenCheck(Golden({HERE: {"fsdp2": values()}}), here=HERE)
    with pytest.raises(AssertionError, match=r"golden new_row: no golden values in .*TORCHTITAN_GOLDEN_RECORD="):
        check.check("new_row", values(), TOLERANCE)


def test_a_key_or_step_missing_fails():
    check = GoldenCheck(Golden({HERE: {"fsdp2": values()}}), here=HERE)
    with pytest.raises(AssertionError, match=r"golden fsdp2: validation_loss logged at steps \[\], golden \[2\]"):
        check.check("fsdp2", {**values(), "validation_loss": {}}, TOLERANCE)


def test_record_merges_rows_and_round_trips_bit_exact(tmp_path):
    path = str(tmp_path / "golden.json")
    odd = values(math.nextafter(7.5, 8.0))
    GoldenCheck(Golden(), here=HERE, record_path=path).check("fsdp2", odd, TOLERANCE)  # nothing to compare with
    record(path, HERE, "tp2", values())
    record(path, OTHER, "tp2", values())
    golden = load_golden(path)
    assert golden.rows == {HERE: {"fsdp2": odd, "tp2": values()}, OTHER: {"tp2": values()}}
    with open(path) as f:
        assert sorted(json.load(f)["fingerprints"][HERE]["rows"]) == ["fsdp2", "tp2"]
