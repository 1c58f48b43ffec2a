"""Fixtures shared by the integration modules (one single-process reference run per session)."""

from __future__ import annotations

import subprocess

import pytest

from tests.integration_tests import (
    BF16,
    DOCS,
    GLOBAL_BATCH,
    MOE,
    VALIDATION,
    MatrixLaunches,
    Row,
    losses_of,
    read_metrics,
    run_train,
)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess]:
    """One process, the whole global batch: (dump folder, the launcher's completed process)."""
    folder = str(tmp_path_factory.mktemp("reference"))
    result = run_train(1, folder, ["--training.batch_size", str(GLOBAL_BATCH), *VALIDATION])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder, result


@pytest.fixture(scope="session")
def reference(reference_run) -> dict[str, list[float]]:
    folder, _ = reference_run
    records = read_metrics(folder)
    for key in ("step", "loss", "tps", "mfu", "memory_gib", "grad_norm", "lr"):
        assert key in records[0], key
    losses = losses_of(folder)
    assert losses["loss"][-1] < losses["loss"][0] - 0.3, f"loss did not fall: {losses['loss']}"
    return losses


@pytest.fixture(scope="session")
def bf16_reference(tmp_path_factory) -> list[float]:
    """The bf16 rows' reference: one process (so the trainer autocasts), the whole global batch."""
    folder = str(tmp_path_factory.mktemp("bf16_reference"))
    result = run_train(1, folder, ["--training.batch_size", str(GLOBAL_BATCH), *BF16])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return losses_of(folder)["loss"]


@pytest.fixture(scope="session")
def moe_reference_run(tmp_path_factory) -> tuple[str, subprocess.CompletedProcess]:
    """The MoE debug model on one process, the whole global batch: (dump folder, completed process)."""
    folder = str(tmp_path_factory.mktemp("moe_reference"))
    result = run_train(1, folder, ["--training.batch_size", str(GLOBAL_BATCH), *MOE])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder, result


@pytest.fixture(scope="session")
def matrix(request, tmp_path_factory) -> MatrixLaunches:
    """The loss-parity rows selected in this session, launched one world size at a time."""
    rows = []
    for item in request.session.items:
        if "matrix" not in item.fixturenames:
            continue  # e.g. the estimator's seq_len-1024 rows: measured by its own launch, not trained here
        params = item.callspec.params if hasattr(item, "callspec") else {}
        for row in (params.get("row"), params.get("twin")):  # twin: a row another row is compared with
            if isinstance(row, Row) and row not in rows:
                rows.append(row)
    return MatrixLaunches(rows, str(tmp_path_factory.mktemp("matrix")))


def _docs_reference(folder: str, extra: list[str]) -> dict[str, list[float]]:
    """One process with block_causal on the short-document corpus; its losses and documents per window."""
    result = run_train(1, folder, ["--training.batch_size", str(GLOBAL_BATCH), *DOCS, *extra])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [r for r in read_metrics(folder) if "loss" in r]
    # every window holds boundaries, else block_causal would equal causal and prove nothing
    docs = [r["documents_per_window"] for r in records]
    assert min(docs) >= 2.0, f"windows of the short-document corpus hold too few documents: {docs}"
    assert all(r["mfu_attention"] == "visible_pairs" for r in records)
    assert "mfu(visible)" in result.stdout + result.stderr
    return {**losses_of(folder), "documents_per_window": docs}


@pytest.fixture(scope="session")
def docs_reference(tmp_path_factory) -> dict[str, list[float]]:
    return _docs_reference(str(tmp_path_factory.mktemp("docs_reference")), [])


@pytest.fixture(scope="session")
def docs_moe_reference(tmp_path_factory) -> dict[str, list[float]]:
    return _docs_reference(str(tmp_path_factory.mktemp("docs_moe_reference")), MOE)
