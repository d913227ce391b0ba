"""`toolkit report RUN_DIR [RUN_DIR ...] [--out FILE]`: a run's curves as PNG + HTML."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from . import app


@app.command("report")
def report_cmd(run_dirs: Annotated[list[Path], typer.Argument(metavar="RUN_DIR...", help="run folders (each holds "
                                                                                             "metrics.jsonl)")],
               out: Annotated[Path | None, typer.Option(
                   "--out", help="FILE: writes FILE.png and FILE.html (a .png or .html suffix is replaced); default: "
                                 "RUN_DIR/report, or for several runs report-A-vs-B in their common folder")] = None,
               overwrite: Annotated[bool, typer.Option("--overwrite", help="replace existing files")] = False) -> None:
    """Loss, learning rate, gradient norm and tokens/s against the step; several runs on shared axes."""
    from ..charts import runs_chart, write_chart
    from ..charts.page import check_chart_paths

    out = out if out is not None else default_report(run_dirs)
    check_chart_paths(out, overwrite)
    fig, tables = runs_chart(run_dirs)
    names = ", ".join(str(d) for d in run_dirs)
    png, page = write_chart(fig, tables, out, f"training curves: {names}", overwrite=overwrite)
    print(f"wrote {png} and {page}")


def default_report(run_dirs: list[Path]) -> Path:
    """Beside the runs: RUN_DIR/report for one run (runs/a/report.png), and for several
    report-A-vs-B in the folder they share (runs/report-a-vs-b.png), so that reports of
    different runs never meet."""
    if len(run_dirs) == 1:
        return run_dirs[0] / "report"
    common = Path(os.path.commonpath([os.path.abspath(d) for d in run_dirs]))
    name = "report-" + "-vs-".join(Path(os.path.abspath(d)).name for d in run_dirs)
    return Path(os.path.relpath(common / name))
