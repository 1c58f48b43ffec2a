"""bench/gpu_check: its CPU dry run end to end, so the GPU check cannot rot between GPU runs; and its golden files
(bench/golden/): the dry run's rows compared with cpu_dry_run.json, each file naming its plan's rows.

The dry run is the command a user types (``python -m bench.gpu_check --cpu-dry-run --out DIR``, from the repository root), in a process
of its own: it hides any GPU and sets its thread count before torch starts, and its sanity section starts a
CPU-only child. The same sections and code as on a GPU, at tiny shapes (bench/gpu_check/plan.py); ~55 s on 2
shared cores. The budget and error paths are checked in process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.gpu_check import golden as goldens
from bench.gpu_check import runs as gpu_runs
from bench.gpu_check.features import DRY_RUN_NO_COMPILE
from bench.gpu_check.plan import Plan, dry_run_plan, gpu_plan
from bench.gpu_check.report import SECTIONS, format_markdown
from bench.gpu_check.runs import SPEC_KEYS, RunSpec
from bench.gpu_check.sections import Budget, Context, runs_section, throughput

REPO = Path(__file__).resolve().parents[3]

# The only skips an honest dry run has: float8 without torchao; a block_causal twin whose kernel 'auto'
# already ran on the CPU (auto = sdpa there); flash-linear-attention's kernel and CUDA graphs, refused off CUDA in the
# keys' own lines; the compiled rows (the dry run compiles nothing).
TORCHAO = importlib.util.find_spec("torchao") is not None
CUDA_GRAPHS_REFUSED = "training.cuda_graphs needs a CUDA device; this run's device is cpu"
ALLOWED_RUN_SKIPS = (
    "same kernel as",
    "model.linear_attention_kernel = 'fla' needs CUDA",
    CUDA_GRAPHS_REFUSED,
    DRY_RUN_NO_COMPILE,
)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, float]:
    out = tmp_path_factory.mktemp("gpu_check")
    env = {
        k: v for k, v in os.environ.items() if k != "PYTHONPATH"
    }  # as typed: no PYTHONPATH, nothing installed needed
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "bench.gpu_check", "--cpu-dry-run", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    print(f"gpu_check --cpu-dry-run: {seconds:.1f} s")
    return proc, out, seconds


def _runs(record: dict) -> list[dict]:
    return record.get("runs") or record.get("configs") or []


def _bf16_step_seconds(report: dict) -> float | None:
    """Seconds of the dry run's bf16 training steps (warm-up steps + timed steps of every bf16 run); None if a bf16
    run does not say (then the CI report counts the whole test as bf16)."""
    total = 0.0
    for record in report.values():
        for run in _runs(record):
            if run.get("dtype") == "bfloat16" and run.get("status") == "ok":
                if run.get("step_s") is None or "first_steps_s" not in run:
                    return None
                total += sum(run["first_steps_s"]) + run["steps"] * run["step_s"]
    return total


@pytest.mark.bf16  # the dry run's fixture: the GPU plan's bf16 runs at tiny shapes
def test_dry_run_every_section_ok(dry_run, record_property):
    proc, out, _ = dry_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report == json.loads((out / "gpu_check.json").read_text())
    assert list(report) == list(SECTIONS)
    for name, record in report.items():
        if name == "golden":  # CPU verdicts show that the comparison runs; they are no speed gate (golden.py)
            assert record["status"] in ("ok", "regressed"), record
            continue
        if name == "float8" and not TORCHAO:
            assert record["status"] == "skipped" and record["reason"].startswith("torchao not installed"), record
            continue
        assert record["status"] == "ok", (name, record)
        allowed = ALLOWED_RUN_SKIPS if TORCHAO or name != "width_8b" else ("torchao not installed",)
        for run in _runs(record):
            if run["status"] == "skipped":
                assert run["reason"].startswith(allowed), (name, run)
            else:
                assert run["status"] == "ok", (name, run)
    # every progress stage logged with its elapsed seconds, so a partial log tells where it stopped
    assert "section families: ok" in proc.stderr and "[gpu_check" in proc.stderr
    bf16_seconds = _bf16_step_seconds(report)
    if bf16_seconds is not None:  # measured: the whole dry run took 20.8 s, 24.0 s with AVX2 kernels
        record_property("bf16_seconds", round(bf16_seconds, 2))


def test_dry_run_measures(dry_run):
    proc, out, _ = dry_run
    report = json.loads((out / "gpu_check.json").read_text())
    sanity = report["sanity"]
    assert sanity["pass"] and sanity["max_abs_diff"] == 0.0, sanity  # CPU vs CPU: the same numbers
    assert len(sanity["device_losses"]) == 5
    for run in report["throughput"]["runs"]:
        assert run["tokens_per_s"] > 0 and 0 < run["mfu_pct"] <= 100, run
    for config in report["estimator"]["configs"]:
        assert config["predicted_gib"] > 0 and config["within_target"], config
    assert "runs" not in report["estimator"]
    attention = report["attention"]["block_causal_vs_causal"]
    assert attention["tps_ratio"] > 0 and attention["loss_max_abs_diff"] > 0  # the masks differ: so do the losses
    assert all(run["finite"] and len(run["losses"]) == run["steps"] for run in report["families"]["runs"])
    # the levers: each row trained, each compared with the base row; bf16 weights (alone and with the chunked
    # loss) move the losses off the base row's, so the key reached the trainer (fused AdamW and the chunked loss
    # round differently by an ulp or none over 5 bf16 steps: no bound on theirs)
    levers = report["levers"]
    assert [run["name"] for run in levers["runs"]] == [spec.name for spec in dry_run_plan().levers]
    assert all(run["status"] == "ok" and run["tokens_per_s"] > 0 for run in levers["runs"]), levers
    diffs = {c["runs"][0]: c["loss_max_abs_diff"] for c in levers["vs_base"]}
    assert len(diffs) == len(levers["runs"]) - 1 and all(c["tps_ratio"] > 0 for c in levers["vs_base"])
    assert all(diffs[name] > 0 for name in diffs if "pure bf16" in name), diffs
    assert all(diffs[name] < 0.05 for name in diffs), diffs  # the same training: the losses agree to a few %
    # the profiled rows' steps broken down (breakdown.py): on the CPU the aten ops' self times and the gaps make up
    # the wall time of the profiled steps
    plan = dry_run_plan()
    profiled = [run for run in report["throughput"]["runs"] if run["name"] == plan.profiled.name] + levers["runs"]
    for run in profiled:
        shares = run["breakdown"]["share_pct"]
        assert shares["gemm"] > 0 and shares["attention"] > 0 and abs(sum(shares.values()) - 100) < 1, (
            run["name"],
            shares,
        )
    # the 8B-width section at one block of the tiny flavor: n_layers reached the model (fewer FLOPs per token than
    # the same config at the flavor's depth), and each float8 recipe is compared with its bf16 row
    wide = report["width_8b"]
    assert [run["name"] for run in wide["runs"]] == [spec.name for spec in plan.width_8b]
    full_depth = next(run for run in report["throughput"]["runs"] if run["name"] == plan.throughput[0].name)
    assert wide["runs"][0]["n_layers"] == 1 and full_depth["n_layers"] is None
    assert 0 < wide["runs"][0]["flops_per_token"] < full_depth["flops_per_token"], (wide["runs"][0], full_depth)
    if TORCHAO:
        assert [c["runs"] for c in wide["vs_bf16"]] == [[s.name, plan.width_8b[0].name] for s in plan.width_8b[1:]]
    _new_sections_measure(report, plan)
    markdown = (out / "gpu_check.md").read_text()
    assert markdown == format_markdown(report)
    for name in SECTIONS[:-1]:
        assert f"| {name} |" in markdown, name
    assert markdown.rstrip("\n").splitlines()[-1].strip("*") == report["golden"]["summary"]


def _new_sections_measure(report: dict, plan: Plan) -> None:
    """The sections issue 85 added, at tiny shapes: each row fed and recorded what its GPU twin measures."""
    # compile: CUDA graphs refused in the key's own line, the compiled rows not run, each eager twin trained
    compiled = {run["name"]: run for run in report["compile"]["runs"]}
    assert [run["name"] for run in report["compile"]["runs"]] == [s.name for pair in plan.compiled for s in pair]
    for row, base in plan.compiled:
        reason = CUDA_GRAPHS_REFUSED if "--training.cuda_graphs" in row.extra else DRY_RUN_NO_COMPILE
        assert compiled[row.name]["reason"] == reason, compiled[row.name]
        assert compiled[base.name]["status"] == ("skipped" if base.compile else "ok"), compiled[base.name]
    # the image family trained on windows with images (the estimator's batches), transformers' Llama trained
    families = {run["name"]: run for run in report["families"]["runs"]}
    image_row = next(spec.name for spec in plan.families if spec.model == "qwen3_5_vl")
    assert families[image_row]["images_per_row"] >= 1 and families[image_row]["finite"], families[image_row]
    assert families["hf llama_tiny"]["finite"] and families["hf llama_tiny"]["model"] == "hf"
    # RL: the rates the trainer logs, and a step's tokens = every completion at seq_len
    (rl,) = report["rl"]["runs"]
    assert rl["trainer_logged"]["generation_tps"] > 0 and rl["trainer_logged"]["update_tps"] > 0, rl
    assert rl["tokens_per_step"] == rl["batch_size"] * rl["seq_len"], rl
    # the pinned asynchronous checkpoint: one save (step 4 of 7, interval 4) inside the timed steps, its blocked
    # seconds the manager's, compared with the same row without checkpoints
    saving, plain = report["checkpoint"]["runs"]
    assert saving["checkpoint"]["async_mode"] == "async_with_pinned_mem", saving
    assert list(saving["checkpoint"]["blocked_s"]) == ["4"] and saving["checkpoint"]["close_wait_s"] >= 0, saving
    assert [c["runs"] for c in report["checkpoint"]["vs"]] == [[saving["name"], plain["name"]]]


def test_dry_run_compares_every_row_with_its_golden_file(dry_run):
    """Every run row the dry run measured has a verdict against bench/golden/cpu_dry_run.json: the file covers the
    dry-run plan, with the same configs, and the report says so row by row and in its last line."""
    _, out, _ = dry_run
    report = json.loads((out / "gpu_check.json").read_text())
    golden = report["golden"]
    assert (golden["kind"], golden["file"]) == ("cpu_dry_run", "bench/golden/cpu_dry_run.json"), golden
    fix = f"re-record it: {goldens.record_command(goldens.load_golden(goldens.DRY_RUN_KIND))} (docs/performance.md)"
    compared = set()
    lines = (out / "gpu_check.md").read_text().splitlines()
    for name in goldens.RUN_SECTIONS:
        for run in report[name].get("runs", []):
            verdict = run["golden"]["verdict"]
            if run["status"] != "ok":
                assert verdict == goldens.NOT_MEASURED, (name, run["name"], run["golden"])
                continue
            assert verdict in (goldens.OK, goldens.REGRESSED, goldens.IMPROVED), (run["name"], run["golden"], fix)
            assert "tokens_per_s" in run["golden"], run["golden"]  # CPU: tokens/s only (no allocator statistics)
            compared.add(run["name"])
            row = next(line for line in lines if line.startswith(f"| {name} | {run['name']} | ok |"))
            assert f"| {verdict}: tokens/s x" in row.replace("**", ""), row
    assert golden["compared"] == len(compared) and compared, golden
    # every golden row ran, but float8's without torchao (its section is skipped whole)
    float8_names = {spec.name for spec in [*dry_run_plan().float8, *dry_run_plan().width_8b] if spec.float8_recipe}
    float8_names.add(dry_run_plan().float8[0].name)
    allowed_missing = set() if TORCHAO else float8_names
    assert {m["name"] for m in golden["missing"]} <= allowed_missing, (golden["missing"], fix)


def _run_rows(plan: Plan) -> list[RunSpec]:
    """The plan's runs that are report rows with tokens/s (golden.RUN_SECTIONS)."""
    return [
        *plan.throughput,
        *plan.if_time_allows,
        *plan.float8,
        *plan.attention,
        *plan.families,
        *plan.linear_attention,
        *plan.features,
        *(spec for pair in plan.compiled for spec in pair),
        *plan.rl,
        *(spec for pair in plan.checkpoint for spec in pair),
        *plan.levers,
        *plan.width_8b,
    ]


@pytest.mark.parametrize("plan", [gpu_plan(), dry_run_plan()], ids=["gpu", "dry_run"])
def test_a_row_name_is_one_config(plan):
    """Golden rows are keyed by name: a name two sections share must be the same run."""
    by_name: dict[str, RunSpec] = {}
    for spec in _run_rows(plan):
        assert by_name.setdefault(spec.name, spec) == spec, (spec.name, by_name[spec.name], spec)


@pytest.mark.parametrize("kind, plan", [("h100", gpu_plan()), ("cpu_dry_run", dry_run_plan())])
def test_golden_rows_are_the_plans_rows(kind, plan):
    """Each golden file names its plan's rows exactly, each with the config the plan runs (the vocabulary aside:
    it is resolved at run time)."""
    rows = goldens.load_golden(kind).rows
    specs = {spec.name: spec for spec in _run_rows(plan)}
    # 'auto' is sdpa on the CPU: the dry run skips its twin; flash-linear-attention runs on CUDA only; the dry run
    # compiles nothing
    skipped_on_cpu = {"tiny block_causal sdpa seq 128", "qwen3_5 tiny fla rule seq 64"}
    skipped_on_cpu |= {spec.name for pair in dry_run_plan().compiled for spec in pair if spec.compile}
    # rows added since the last GPU session recorded its golden file (issue 59): recorded at the next one
    not_yet_on_gpu = {"qwen3_5 0.8B torch rule seq 4096", "qwen3_5 0.8B fla rule seq 4096"}
    not_yet_on_gpu |= {spec.name for spec in gpu_plan().levers[1:]}  # issue 57's levers: the base row is recorded
    not_yet_on_gpu |= {spec.name for spec in gpu_plan().width_8b}  # issue 57's 8B width
    # issue 85: CUDA graphs, compiled MoE and Qwen3.5 (their eager twins too), the image family, hf, RL, the pinned
    # checkpoint (the compiled 1B row they are compared with is recorded)
    gpu = gpu_plan()
    issue_85 = {spec.name for pair in [*gpu.compiled, *gpu.checkpoint] for spec in pair} | {s.name for s in gpu.rl}
    issue_85 |= {spec.name for spec in gpu.families if spec.model in ("qwen3_5_vl", "hf")}
    not_yet_on_gpu |= issue_85 - {spec.name for spec in gpu.throughput}
    fix = f"re-record it: {goldens.record_command(goldens.load_golden(kind))} (docs/performance.md)"
    assert set(rows) == set(specs) - (skipped_on_cpu if kind == "cpu_dry_run" else not_yet_on_gpu), fix
    for name, row in rows.items():
        assert set(row["spec"]) == set(SPEC_KEYS), (name, fix)
        described = json.loads(json.dumps(specs[name].describe()))
        recorded = {k: v for k, v in row["spec"].items() if k != "vocab"}
        assert recorded == {k: described[k] for k in SPEC_KEYS if k != "vocab"}, (name, fix)


def _context(tmp_path: Path, budget_s: float) -> Context:
    return Context(torch.device("cpu"), dry_run_plan(), tmp_path, Budget(budget_s), lambda line: None, True)


def test_time_budget_skips_runs(tmp_path):
    record = throughput(_context(tmp_path, budget_s=0.0))
    assert record["status"] == "skipped" and record["reason"].startswith("time budget"), record
    assert all(run["status"] == "skipped" for run in record["runs"])


def test_failed_run_is_recorded_and_the_section_goes_on(tmp_path):
    ctx = _context(tmp_path, budget_s=60.0)
    bad = ctx.run(RunSpec("bad flavor", "no_such_flavor", 64, 2))
    assert bad["status"] == "error" and "no_such_flavor" in bad["error"] and bad["traceback"], bad
    record = runs_section([bad, {"name": "next", "status": "ok"}])
    assert record["status"] == "error" and "bad flavor" in record["error"]
    assert [r["status"] for r in record["runs"]] == ["error", "ok"]


def test_a_run_leaves_the_process_flags_as_it_found_them(tmp_path):
    """A run's process-wide flags do not reach the runs after it: the features section's step replay trains with
    ``training.deterministic`` (on the H100 the rows after it read 7-20% slower), a float8 run on a CPU whose
    oneDNN float8 GEMM is slow turns oneDNN off (the dry run's later rows ran ~4x slower); docs/performance.md."""
    replay = next(spec for spec in dry_run_plan().features if "--training.deterministic" in spec.extra)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.mkldnn.enabled)
    torch.use_deterministic_algorithms(False)
    torch.backends.mkldnn.enabled = True
    during = []

    def as_float8_would(trainer) -> None:  # what float8.turn_off_onednn does, on every CPU kind
        during.append(torch.are_deterministic_algorithms_enabled())
        torch.backends.mkldnn.enabled = False

    try:
        result = gpu_runs.run(replay, torch.device("cpu"), tmp_path, before_training=as_float8_would)
        assert result["status"] == "ok" and during == [True], (result.get("error"), during)
        assert not torch.are_deterministic_algorithms_enabled() and torch.backends.mkldnn.enabled
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.mkldnn.enabled = before[1]


@pytest.mark.parametrize("section", ["levers", "width_8b"])
def test_a_section_apart_runs_alone_with_the_environment(section, tmp_path, capsys):
    """``--section NAME``: the environment, then that section (its runs skipped here by a zero budget); every other
    section says it was not run and why."""
    from bench.gpu_check.__main__ import APART, run_check

    assert section in APART
    # run_check sets automatic_dynamic_shapes; dynamo's own patch puts it back (pytest's monkeypatch deletes a
    # config on undo: the next compile then finds no such config)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=torch._dynamo.config.automatic_dynamic_shapes):
        golden = goldens.load_golden("cpu_dry_run")
        report = run_check(_context(tmp_path, budget_s=0.0), golden, 120.0, only=section)
    assert report.sections["environment"]["status"] == "ok", report.sections["environment"]
    record = report.sections[section]
    assert [run["name"] for run in record["runs"]] == [spec.name for spec in getattr(dry_run_plan(), section)]
    assert record["status"] == "skipped" and all(run["status"] == "skipped" for run in record["runs"]), record
    for name in set(SECTIONS) - {"environment", section, "golden"}:
        other = report.sections[name]
        assert other["status"] == "skipped" and other["reason"].startswith(f"not run: --section {section}"), other
    assert json.loads(capsys.readouterr().out) == json.loads(report.to_json())


def test_imports_without_the_packages_gpu_machines_lack():
    """The GPU machines have no datasets, torchdata, torchao or torchft: the check and all it imports load without."""
    lacking = ("datasets", "torchdata", "torchao", "torchft")
    # a None entry in sys.modules makes ``import name`` raise ImportError
    code = f"import sys; sys.modules.update(dict.fromkeys({lacking!r}))\n"
    code += "import bench.gpu_check.sections, bench.gpu_check.environment, bench.gpu_check.report"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
