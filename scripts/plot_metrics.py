"""Plot the metrics.jsonl of one or more training runs into one PNG.

    python scripts/plot_metrics.py outputs/run_a outputs/run_b -o runs.png
    python scripts/plot_metrics.py outputs/single outputs/fsdp2 -o diff.png --diff

Default: three panels against the step, one line per run: loss (validation loss, when the run has
it, as dashed markers in the same panel), tokens/s per rank, and peak memory (GiB). With --diff:
the per-step loss of each run minus the first run's, over the steps both logged, for parity checks.

Reading and parsing need only the standard library; matplotlib is imported when plotting.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
INSTALL_HINT = 'matplotlib is not installed: pip install matplotlib (or pip install -e ".[plot]")'

# Training-record series drawn in the default figure: (metrics.jsonl key, panel title, y label).
TRAIN_PANELS = (
    ("loss", "loss", "loss"),
    ("tps", "throughput", "tokens/s per rank"),
    ("memory_gib", "peak memory", "GiB"),
)


class PlotError(Exception):
    """A user-facing problem with the input: printed as one line, exit status 2."""


@dataclass
class Run:
    """The metrics of one run: each series is a {step: value} dict."""

    path: Path
    label: str = ""
    series: dict[str, dict[int, float]] = field(default_factory=dict)

    def get(self, key: str) -> dict[int, float]:
        return self.series.get(key, {})


# --------------------------------------------------------------------------- reading


def _parse_line(line: str, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise PlotError(f"{where}: malformed JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise PlotError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def _add_record(series: dict[str, dict[int, float]], record: dict[str, Any]) -> None:
    """Keep every numeric key, known or not; records without an integer step are not plottable."""
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        series.setdefault(key, {})[step] = float(value)


def read_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """Read <run_dir>/metrics.jsonl into {key: {step: value}}; blank lines are skipped.

    Raises:
        PlotError: missing folder or file, no records, or a malformed line (file:line named).
    """
    if not run_dir.is_dir():
        raise PlotError(f"run folder not found: {run_dir}")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise PlotError(f"no {METRICS_FILE} in {run_dir} (was the run started with this dump_folder?)")
    series: dict[str, dict[int, float]] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                _add_record(series, _parse_line(line, f"{path}:{lineno}"))
    if not series:
        raise PlotError(f"{path} is empty: no metrics were logged")
    return series


def default_labels(run_dirs: list[Path]) -> list[str]:
    """The folder name of each run, or parent/name where two runs share a name."""
    names = [d.resolve().name for d in run_dirs]
    return [
        f"{d.resolve().parent.name}/{name}" if names.count(name) > 1 else name
        for d, name in zip(run_dirs, names, strict=True)
    ]


def load_runs(run_dirs: list[Path], labels: list[str] | None = None) -> list[Run]:
    if labels is not None and len(labels) != len(run_dirs):
        raise PlotError(f"--labels has {len(labels)} names for {len(run_dirs)} run folders")
    labels = labels or default_labels(run_dirs)
    return [Run(d, label, read_metrics(d)) for d, label in zip(run_dirs, labels, strict=True)]


# --------------------------------------------------------------------------- diff math


def compute_loss_diff(base: dict[int, float], other: dict[int, float]) -> dict[int, float]:
    """other - base at each step both runs logged."""
    return {s: other[s] - base[s] for s in sorted(base.keys() & other.keys())}


def max_abs(values: dict[int, float]) -> float:
    return max((abs(v) for v in values.values()), default=math.nan)


# --------------------------------------------------------------------------- plotting


def _import_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotError(INSTALL_HINT) from None
    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def _draw(ax: Any, values: dict[int, float], **style: Any) -> Any:
    steps = sorted(values)
    return ax.plot(steps, [values[s] for s in steps], **style)[0]


def _draw_train_panels(axes: list[Any], runs: list[Run]) -> None:
    for ax, (key, title, ylabel) in zip(axes, TRAIN_PANELS, strict=True):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        for i, run in enumerate(runs):
            # Later runs drawn thinner, so identical curves still show every run.
            line = _draw(ax, run.get(key), label=run.label, linewidth=max(3.5 - 1.0 * i, 1.0))
            if key == "loss" and run.get("validation_loss"):
                _draw(
                    ax,
                    run.get("validation_loss"),
                    color=line.get_color(),
                    linestyle="--",
                    marker="o",
                    markersize=4,
                    label=f"{run.label} (validation)",
                )


def _draw_diff_panel(ax: Any, runs: list[Run]) -> None:
    base = runs[0]
    ax.set_title(f"loss difference vs {base.label}")
    ax.set_ylabel("Δ loss (run − first)")
    ax.axhline(0.0, color="grey", linewidth=0.8)
    for run in runs[1:]:
        diff = compute_loss_diff(base.get("loss"), run.get("loss"))
        if not diff:
            raise PlotError(f"{run.path} and {base.path} have no logged step in common")
        _draw(ax, diff, marker=".", label=f"{run.label}: max |Δ| = {max_abs(diff):.3g}")


def plot_runs(runs: list[Run], out: Path, *, diff: bool = False, title: str | None = None) -> None:
    """Write one PNG: the three training panels, or with diff the loss difference panel."""
    if diff and len(runs) < 2:
        raise PlotError("--diff needs at least two run folders")
    plt = _import_pyplot()
    num_panels = 1 if diff else len(TRAIN_PANELS)
    fig, axes = plt.subplots(num_panels, 1, figsize=(8, 2.8 * num_panels + 0.6), sharex=True, squeeze=False)
    axes = list(axes[:, 0])
    if diff:
        _draw_diff_panel(axes[0], runs)
    else:
        _draw_train_panels(axes, runs)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Plot loss, tokens/s and memory of training runs from their metrics.jsonl."
    )
    parser.add_argument(
        "run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="a run's job.dump_folder (holds metrics.jsonl)"
    )
    parser.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    parser.add_argument(
        "--diff", action="store_true", help="plot each run's per-step loss minus the first run's (parity check)"
    )
    parser.add_argument("--labels", help="comma-separated legend names, one per run (default: the folder names)")
    parser.add_argument("--title", help="figure title")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    try:
        runs = load_runs(args.run_dirs, labels)
        plot_runs(runs, args.output, diff=args.diff, title=args.title)
    except PlotError as e:
        print(f"plot_metrics: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
