"""`toolkit report RUN_DIR [RUN_DIR ...] --out FILE`: a run's curves as PNG + HTML."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from . import app


@app.command("report")
def report_cmd(run_dirs: Annotated[list[Path], typer.Argument(metavar="RUN_DIR...", help="run folders (each holds "
                                                                                             "metrics.jsonl)")],
               out: Annotated[Path, typer.Option("--out", help="FILE: writes FILE.png and FILE.html (a .png or "
                                                               ".html suffix is replaced)")],
               overwrite: Annotated[bool, typer.Option("--overwrite", help="replace existing files")] = False) -> None:
    """Loss, learning rate, gradient norm and tokens/s against the step; several runs on shared axes."""
    from ..charts import runs_chart, write_chart
    from ..charts.page import check_chart_paths

    check_chart_paths(out, overwrite)
    fig, tables = runs_chart(run_dirs)
    names = ", ".join(str(d) for d in run_dirs)
    png, page = write_chart(fig, tables, out, f"training curves: {names}", overwrite=overwrite)
    print(f"wrote {png} and {page}")
