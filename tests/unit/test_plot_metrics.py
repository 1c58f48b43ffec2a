from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import IO

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "plot_metrics.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plot_metrics", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


plot_metrics = _load_script()


def _train_record(step: int, loss: float) -> dict[str, float]:
    return {
        "step": step,
        "loss": loss,
        "loss_max": loss + 0.01,
        "grad_norm": 0.5,
        "lr": 1e-3,
        "tps": 1000.0 + step,
        "mfu": 10.0,
        "memory_gib": 1.0 + 0.01 * step,
        "step_time_s": 0.1,
        "data_time_s": 0.01,
    }


def _write_run(path: Path, losses: list[float], *, validation: bool = False) -> Path:
    path.mkdir(parents=True)
    lines = []
    for step, loss in enumerate(losses, start=1):
        lines.append(json.dumps(_train_record(step, loss)))
        if validation and step % 2 == 0:
            lines.append(
                json.dumps(
                    {"step": step, "validation_loss": loss + 0.1, "validation_perplexity": 2.0, "some_future_key": "x"}
                )
            )
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], check=False, capture_output=True, text=True, timeout=120
    )


def _assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    a = _write_run(tmp_path / "a" / "run", [8.0, 7.5, 7.0, 6.8])
    b = _write_run(tmp_path / "b" / "run", [8.0, 7.4, 7.1], validation=True)
    return a, b


# --------------------------------------------------------------------------- reading (no matplotlib)


def test_read_metrics_keeps_both_record_kinds(two_runs: tuple[Path, Path]) -> None:
    series = plot_metrics.read_metrics(two_runs[1])
    assert series["loss"] == {1: 8.0, 2: 7.4, 3: 7.1}
    assert series["validation_loss"] == pytest.approx({2: 7.5})
    assert "some_future_key" not in series  # non-numeric values are skipped


def test_default_labels_disambiguate_same_name(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    assert plot_metrics.default_labels(list(two_runs)) == ["a/run", "b/run"]
    assert plot_metrics.default_labels([two_runs[0], tmp_path / "other"]) == ["run", "other"]


def test_loss_diff_over_common_steps() -> None:
    diff = plot_metrics.compute_loss_diff({1: 8.0, 2: 7.0, 3: 6.0}, {1: 8.0, 2: 7.5})
    assert diff == {1: 0.0, 2: 0.5}
    assert plot_metrics.max_abs(diff) == 0.5


# --------------------------------------------------------------------------- PNG output


@pytest.mark.parametrize("diff", [False, True])
def test_png_written(two_runs: tuple[Path, Path], tmp_path: Path, diff: bool) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out.png"
    args = [*map(str, two_runs), "-o", str(out), "--title", "t", "--labels", "first,second"]
    assert plot_metrics.main(args + (["--diff"] if diff else [])) == 0
    width, height = _png_size(out)
    assert width > 100 and height > 100


def test_missing_matplotlib_is_one_line(
    two_runs: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert plot_metrics.main([*map(str, two_runs), "-o", str(tmp_path / "x.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


# --------------------------------------------------------------------------- CLI errors


def test_missing_folder(tmp_path: Path) -> None:
    proc = _run_cli(tmp_path / "nope", "-o", tmp_path / "x.png")
    _assert_one_line_error(proc, "run folder not found", "nope")


def test_malformed_line_names_file_and_line(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    metrics = two_runs[0] / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 5, "loss": \n')
    proc = _run_cli(*two_runs, "-o", tmp_path / "x.png")
    _assert_one_line_error(proc, f"{metrics}:5:", "malformed")


def test_empty_metrics_file(tmp_path: Path) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    _assert_one_line_error(_run_cli(run, "-o", tmp_path / "x.png"), "empty")


def test_missing_metrics_file(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    _assert_one_line_error(_run_cli(tmp_path / "run", "-o", tmp_path / "x.png"), "metrics.jsonl")


# --------------------------------------------------------------------------- two real runs


def _start_training(dump_folder: Path, log: IO[str]) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "torchtitan.train",
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--training.steps",
        "3",
        "--training.seq_len",
        "64",
        "--training.batch_size",
        "2",
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(dump_folder),
    ]
    # One thread each: the two runs go side by side (start-up dominates), on the same thread count.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _train_side_by_side(dump_folders: list[Path]) -> None:
    logs = [folder.with_suffix(".log") for folder in dump_folders]
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(log.open("w")) for log in logs]
        procs = [_start_training(folder, f) for folder, f in zip(dump_folders, files, strict=True)]
        codes = [proc.wait(timeout=300) for proc in procs]
    for code, log in zip(codes, logs, strict=True):
        assert code == 0, log.read_text()[-3000:]


def test_png_from_two_real_runs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    runs = [tmp_path / "run1", tmp_path / "run2"]
    _train_side_by_side(runs)
    for run in runs:
        assert sorted(plot_metrics.read_metrics(run)["loss"]) == [1, 2, 3]
    for extra in ([], ["--diff"]):
        out = tmp_path / f"plot{'_'.join(extra)}.png"
        assert plot_metrics.main([*map(str, runs), "-o", str(out), *extra]) == 0
        width, height = _png_size(out)
        assert width > 100 and height > 100
    # Same config and seed on one process: the runs are deterministic, so the difference is zero.
    series = [plot_metrics.read_metrics(run)["loss"] for run in runs]
    assert plot_metrics.max_abs(plot_metrics.compute_loss_diff(*series)) == 0.0
