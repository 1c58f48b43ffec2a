"""Training on a 3-source indexed blend (``training.dataset_mix``), through the trainer in the worker pool.

The corpora are written by the test (jsonl in a temporary folder: web = the shipped pydocs corpus' first
documents, code = this package's own Python files, math = a few lines of sums, small enough to be read more
than once in 6 steps) and tokenized with the shipped tokenizer by tokenize_data.py's function.

* Loss parity (RTOL 1e-5 per step, grad norms within the matrix's GRAD_NORM_RTOL): one process vs FSDP2,
  FSDP2 + accumulation 2, PP2 (1F1B); every layout logs the same samples per source per step.
* The start summary names the data by its kind: a blend, one indexed corpus (issue 56, item 5).
* Exact resume: the reference saves step 3 (the math source is then mid-way through its second epoch); the
  same layout resumed from it gives steps 4-6 bit-exact, FSDP2 (another data-parallel degree) within RTOL, with
  the same samples per source.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.support.matrix import GRAD_NORM_RTOL, RTOL, Row, check_grad_norms, pp_schedule
from tests.support.runs import GLOBAL_BATCH, ROOT, STEPS, check_job, launch_jobs, read_metrics, trainer_argv

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2)]

# The blend's layouts: the reference and one row per code path that reads the loader differently (several
# data-parallel ranks, micro-batches, pipeline stages on one data-parallel rank).
BLEND_ROWS = [
    Row("blend_reference", 1, 8),
    Row("blend_fsdp2", 2, 4),
    Row("blend_fsdp2_grad_accum2", 2, 2, ["--training.gradient_accumulation_steps", "2"]),
    Row("blend_pp2_1f1b", 2, 8, pp_schedule("1F1B"), pp=2),
]
# Resumed from the reference's step 3: on its own layout, and as FSDP2 (data-parallel degree 1 -> 2).
RESUME_ROWS = [Row("blend_resume_same_layout", 1, 8), Row("blend_resume_fsdp2", 2, 4)]
CKPT = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "3"]
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


def _write(path: Path, texts: list[str]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> dict[str, str]:
    from torchtitan.datasets.indexed.tokenize import tokenize_to_indexed
    from torchtitan.datasets.tokenizer import DEFAULT_TOKENIZER_PATH

    folder = tmp_path_factory.mktemp("blend_data")
    with open(os.path.join(ROOT, "torchtitan/datasets/assets/pydocs/pydocs.jsonl"), encoding="utf-8") as f:
        web = [json.loads(line)["text"] for _, line in zip(range(60), f)]
    code = [p.read_text() for p in sorted(Path(ROOT, "torchtitan/datasets").glob("*.py"))]
    math = [f"{a} + {b} = {a + b}. {a} * {b} = {a * b}." for a, b in zip(range(3, 15), range(20, 44, 2))]
    prefixes = {}
    for name, texts in (("web", web), ("code", code), ("math", math)):
        prefixes[name] = str(folder / name)
        tokenize_to_indexed(
            _write(folder / f"{name}.jsonl", texts),
            prefixes[name],
            os.path.join(ROOT, DEFAULT_TOKENIZER_PATH),
            progress=io.StringIO(),
        )
    return prefixes


def _argv(row: Row, folder: str, prefixes: dict[str, str], *extra: str) -> list[str]:
    mix = ",".join(f"{prefixes[n]}:{w}" for n, w in WEIGHTS.items())
    return trainer_argv(
        ["--training.batch_size", str(row.local_batch), *row.args(), "--training.dataset_mix", mix, *extra], folder
    )


@pytest.fixture(scope="module")
def runs(blend, tmp_path_factory) -> dict[str, list[dict]]:
    """Every row's and resume's metrics.jsonl records (the 1-rank jobs first, then the 2-rank ones)."""
    base = tmp_path_factory.mktemp("blend_runs")
    folders = {r.name: str(base / r.name) for r in BLEND_ROWS + RESUME_ROWS}
    ref, same, fsdp2 = BLEND_ROWS[0], RESUME_ROWS[0], RESUME_ROWS[1]
    first = launch_jobs(1, [_argv(ref, folders[ref.name], blend, *CKPT)], str(base / "ref.json"))
    check_job(ref.name, folders[ref.name], first)
    for resume in RESUME_ROWS:  # the step-3 checkpoint in a folder of its own: the run resumes from it
        saved = os.path.join(folders[ref.name], "checkpoint", "step-3")
        shutil.copytree(saved, os.path.join(folders[resume.name], "checkpoint", "step-3"))
    again = launch_jobs(1, [_argv(same, folders[same.name], blend, *CKPT)], str(base / "same.json"))
    check_job(same.name, folders[same.name], again)
    two = [_argv(r, folders[r.name], blend) for r in BLEND_ROWS[1:]] + [_argv(fsdp2, folders[fsdp2.name], blend, *CKPT)]
    launched = launch_jobs(2, two, str(base / "two.json"))
    out = {}
    for row in BLEND_ROWS + RESUME_ROWS:
        log = check_job(row.name, folders[row.name], launched)
        if row in RESUME_ROWS:
            assert "resumed from step 3" in log, log[-2000:]
            step3 = os.path.join(folders[row.name], "checkpoint", "step-3")
            assert f"start       resumed from step 3 ({step3})\n" in log, log[-2000:]
        assert "data        blend of 3: " in log, log[-2000:]
        out[row.name] = [r for r in read_metrics(folders[row.name]) if "loss" in r]
    return out


def _samples(records: list[dict], prefixes: dict[str, str]) -> list[list[int]]:
    return [[r["data_samples"][prefixes[n]] for n in WEIGHTS] for r in records]


@pytest.mark.parametrize("row", BLEND_ROWS[1:], ids=[r.name for r in BLEND_ROWS[1:]])
def test_blend_loss_parity_and_samples_per_source(row: Row, runs, blend):
    ref, got = runs[BLEND_ROWS[0].name], runs[row.name]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for want, have in zip(ref, got, strict=True):
        assert abs(have["loss"] - want["loss"]) <= RTOL * abs(want["loss"]), f"step {want['step']}: {row.name}"
    check_grad_norms(row.name, [r["grad_norm"] for r in got], [r["grad_norm"] for r in ref], GRAD_NORM_RTOL)
    assert _samples(got, blend) == _samples(ref, blend)
    assert all(r["data_tokens"][blend["web"]] == r["data_samples"][blend["web"]] * 64 for r in got)


def test_blend_reference_follows_the_weights_and_learns(runs, blend):
    ref = runs[BLEND_ROWS[0].name]
    counts = _samples(ref, blend)
    assert all(sum(c) == GLOBAL_BATCH for c in counts)
    seen = [sum(c[j] for c in counts) for j in range(3)]
    n = STEPS * GLOBAL_BATCH
    assert all(abs(s - w * n) < 1 for s, w in zip(seen, WEIGHTS.values())), seen
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.3, [r["loss"] for r in ref]


def test_blend_resumes_exactly_mid_epoch_under_another_dp_degree(runs, blend):
    from torchtitan.datasets.indexed.format import IndexedFile

    ref = runs[BLEND_ROWS[0].name]
    math_windows = IndexedFile(blend["math"]).num_tokens // 65
    math_read = sum(c[2] for c in _samples(ref[:3], blend))
    assert math_read > math_windows and math_read % math_windows, (math_read, math_windows)  # mid second epoch
    same = runs[RESUME_ROWS[0].name]
    assert [r["step"] for r in same] == [4, 5, 6]
    assert [r["loss"] for r in same] == [r["loss"] for r in ref[3:]]  # bit-exact
    fsdp2 = runs[RESUME_ROWS[1].name]
    assert _samples(fsdp2, blend) == _samples(ref[3:], blend)
    for want, have in zip(ref[3:], fsdp2, strict=True):
        assert abs(have["loss"] - want["loss"]) <= RTOL * abs(want["loss"]), f"step {want['step']}"


def test_a_run_on_one_indexed_corpus_names_it_indexed(blend, tmp_path):
    """Issue 56, item 5: the start summary names an indexed dataset_path by its kind (it said 'pydocs (text, PREFIX)',
    the default dataset's name and format). One step, one rank."""
    folder = str(tmp_path / "indexed")
    overrides = ["--training.batch_size", "8", "--training.steps", "1", "--training.dataset_path", blend["math"]]
    launched = launch_jobs(1, [trainer_argv(overrides, folder)], str(tmp_path / "indexed.json"))
    log = check_job("indexed", folder, launched)
    assert f"data        indexed: {blend['math']}\n" in log, log[-2000:]
