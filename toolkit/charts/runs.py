"""`toolkit report`: loss (validation loss dashed, when the run evaluated), learning rate,
gradient norm and tokens/s against the step, from each run folder's metrics.jsonl (one JSON
line per logged step, written by rank 0), several runs on shared axes: the comparison between
layouts, or before and after a resume."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputFileError, MissingInputError
from .page import Table

SERIES = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm"), ("tokens_per_s", "tokens/s"))
COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s")


@dataclass(frozen=True)
class RunMetrics:
    name: str
    rows: tuple[dict, ...]  # metrics.jsonl records, in step order

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric; steps without a value (grad_norm: None) are left out."""
        points = [(r["step"], r[key]) for r in self.rows if r.get(key) is not None]
        return [s for s, _ in points], [float(v) for _, v in points]


def _record(path: Path, n: int, line: str) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        raise InputFileError(f"{path}:{n}: not a JSON line") from None
    if not isinstance(rec, dict) or "step" not in rec or "loss" not in rec:
        raise InputFileError(f"{path}:{n}: expected an object with 'step' and 'loss'")
    return rec


def read_run(run_dir: str | Path, name: str | None = None) -> RunMetrics:
    d = Path(run_dir)
    if not d.is_dir():
        raise MissingInputError(f"run folder '{d}' does not exist")
    path = d / "metrics.jsonl"
    if not path.is_file():
        raise MissingInputError(f"'{path}' does not exist (a run writes it on rank 0 as it trains)")
    rows = [_record(path, n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not rows:
        raise InputFileError(f"'{path}' holds no steps yet")
    return RunMetrics(name or str(d), tuple(sorted(rows, key=lambda r: r["step"])))


def runs_figure(runs: list[RunMetrics]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8), layout="constrained")
    for ax, (key, label) in zip(fig.subplots(2, 2).flat, SERIES):
        for run in runs:
            steps, values = run.series(key)
            line = ax.plot(steps, values, label=run.name, marker="." if len(steps) <= 50 else None)[0]
            if key == "loss" and run.series("valid_loss")[0]:  # train.eval_interval: the same colour, dashed
                ax.plot(*run.series("valid_loss"), linestyle="--", marker="x", color=line.get_color(),
                        label=f"{run.name} (validation)")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    handles, labels = fig.axes[0].get_legend_handles_labels()  # one entry per run, above the four panels
    fig.legend(handles, labels, loc="outside upper center", ncols=min(len(runs), 3), fontsize="small")
    return fig


def runs_tables(runs: list[RunMetrics]) -> list[Table]:
    """One table per run; a valid_loss column when the run evaluated (train.eval_interval)."""
    tables = []
    for run in runs:
        cols = COLUMNS + (("valid_loss",) if run.series("valid_loss")[0] else ())
        tables.append(Table(f"{run.name}: metrics.jsonl", cols, tuple(tuple(r.get(c) for c in cols) for r in run.rows)))
    return tables


def runs_chart(run_dirs: list[str | Path]) -> tuple[object, list[Table]]:
    """(figure, tables) for run folders; each run is named by its folder as given."""
    runs = [read_run(d) for d in run_dirs]
    return runs_figure(runs), runs_tables(runs)
