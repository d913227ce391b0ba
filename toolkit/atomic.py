"""Nothing half-written: outputs are built in a temporary sibling folder and renamed into
place at the end; existing data is replaced only when asked."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import OutputExistsError


def check_output_dir(path: str | Path, overwrite: bool) -> Path:
    p = Path(path)
    if p.exists() and not overwrite:
        raise OutputExistsError(f"output '{p}' already exists (pass --overwrite to replace it)")
    if p.exists() and not p.is_dir():
        raise OutputExistsError(f"output '{p}' exists and is not a folder")
    return p


@contextlib.contextmanager
def atomic_output_dir(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes `path`, on any error it is removed."""
    final = check_output_dir(path, overwrite).resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the result is an ordinary folder
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.replace(final, trash / "old")
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
