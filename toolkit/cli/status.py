"""`toolkit status RUN_DIR`: where a training run stands (toolkit.runtime.run_status)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from . import app


@app.command("status")
def status_cmd(run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="a training run's folder (its --out)")]
               ) -> None:
    """The last step and its loss, the recent throughput, the latest complete checkpoint, and
    whether the run is alive (on any machine that shares the folder)."""
    from ..runtime.run_status import status

    print("\n".join(status(run_dir).lines()))
