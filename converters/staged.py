"""A legacy checkpoint converted a few pipeline stages at a time (``--stages``), by commands that
may run on several hosts at once, into one folder on a shared file system.

While stages are missing the folder holds ``.stages/``: ``plan.json`` (the checkpoint's args,
which every command must share: a command with another layout, dtype or model is refused),
``hf/`` (the side folder, written once) and ``stage-KKK/`` for each stage converted, holding its
rank folders (``mp_rank_TT_KKK[_EEE]``), each stage renamed into place whole (toolkit.atomic).
Megatron's tracker (``latest_checkpointed_iteration.txt``) is absent, and the readers refuse the
folder naming the missing stages (``check_finished``). The command that finds every stage present
after its own rename finishes the folder under ``.stages/lock`` (a POSIX record lock, which NFS
honours, dropped when its process ends however it ends): the rank folders and ``hf/`` are
renamed to their places, the tracker is written last, and ``.stages/`` is removed, so that the
result holds exactly the files, byte for byte, of the whole conversion.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from toolkit.atomic import atomic_output_dir, discard, fsync_path, publish

from toolkit.errors import OutputExistsError

from .errors import CheckpointError, ConversionSetupError

STAGING = ".stages"
PLAN = "plan.json"
LOCK = "lock"
TRACKER = "latest_checkpointed_iteration.txt"  # formats.torch_legacy.ITERATION_FILE (not imported: readers use this)


def parse_stages(text: str | tuple[int, int], pp: int) -> range:
    """``"A"`` or ``"A-B"`` (0-based, inclusive), or (A, B) -> the stages A..B, checked against
    the pipeline's pp stages."""
    if isinstance(text, tuple):
        first, last = text
    else:
        a, _, b = str(text).partition("-")
        if not a.strip().isdigit() or (b and not b.strip().isdigit()):
            raise ConversionSetupError(f"--stages '{text}': use a stage number or a range A-B (0-based)")
        first, last = int(a), int(b or a)
    if not 0 <= first <= last < pp:
        raise ConversionSetupError(f"--stages {first}-{last} is outside the layout: pp={pp} has stages 0-{pp - 1}")
    return range(first, last + 1)


def stage_dir(out: Path, stage: int) -> Path:
    return out / STAGING / f"stage-{stage:03d}"


def _plan(out: Path) -> dict | None:
    p = out / STAGING / PLAN
    return json.loads(p.read_text()) if p.is_file() else None


def missing_stages(out: Path) -> list[int] | None:
    """The stages not yet converted into an unfinished staged folder; None for any other folder."""
    plan = _plan(Path(out))
    if plan is None or (Path(out) / TRACKER).is_file():
        return None
    return [k for k in range(plan["pp"]) if not stage_dir(Path(out), k).is_dir()]


def check_finished(root: Path) -> None:
    """Refuse an unfinished staged folder (a reader's first step), naming its missing stages."""
    missing = missing_stages(root)
    if missing is None:
        return
    if missing:
        raise CheckpointError(f"'{root}' is an unfinished staged conversion: stage(s) "
                              f"{', '.join(map(str, missing))} of pp={_plan(root)['pp']} are missing "
                              "(convert them with --stages)")
    raise CheckpointError(f"'{root}' holds every stage but was not finished (its last command stopped): "
                          "convert any stage again with --overwrite to finish it")


def plan_of(args: Any, pp: int) -> dict:
    """What every command converting into one folder must agree on: the checkpoint's args."""
    return {"pp": pp, "args": json.loads(json.dumps(vars(args), default=str))}


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[bool]:
    """Hold the folder's staging lock; yields False (holding nothing) when the folder is finished.
    The finishing command removes the lock file, so a waiter checks it locked the file still there."""
    while True:
        if (out / TRACKER).is_file():
            yield False
            return
        d = out / STAGING
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(d / LOCK))
            except FileNotFoundError:
                current = False
            if current and (out / TRACKER).is_file():  # finished between the check and the mkdir: undo it
                shutil.rmtree(d, ignore_errors=True)
                current = False
            if current:
                yield True
                return
        finally:
            os.close(fd)


def begin(out: Path, plan: dict, stages: range, overwrite: bool, write_side) -> None:
    """Join (or start) the staged conversion into ``out``: refuse another plan, a finished folder
    and (without ``overwrite``) a stage converted already; ``write_side(folder)`` writes the HF
    side folder, once."""
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"output '{out}' exists and is not a folder")
    finished = OutputExistsError(f"output '{out}' is a finished checkpoint already (remove it to convert it "
                                 "again in stages, or convert the whole checkpoint with --overwrite)")
    if (out / TRACKER).is_file():
        raise finished
    if out.is_dir() and not (out / STAGING).is_dir() and any(out.iterdir()):
        raise OutputExistsError(f"output '{out}' already exists and is not an unfinished staged conversion "
                                "(remove it, or convert the whole checkpoint with --overwrite)")
    with _locked(out) as staging:
        if not staging:
            raise finished
        _agree(out, plan)
        done = [k for k in stages if stage_dir(out, k).is_dir()]
        if done and not overwrite:
            raise OutputExistsError(f"stage(s) {', '.join(map(str, done))} of '{out}' are converted already "
                                    "(pass --overwrite to convert them again)")
        if not (out / STAGING / "hf").is_dir():
            with atomic_output_dir(out / STAGING / "hf") as tmp:
                write_side(tmp)


def _agree(out: Path, plan: dict) -> None:
    """Write the plan, or check this command's against the one written."""
    found = _plan(out)
    if found is None:
        tmp = out / STAGING / f".{PLAN}.{os.getpid()}"
        tmp.write_text(json.dumps(plan, indent=1) + "\n")
        publish(tmp, out / STAGING / PLAN)
        return
    keys = list(plan["args"]) + [k for k in found["args"] if k not in plan["args"]]  # the args' own order
    diff = [k for k in keys if found["args"].get(k) != plan["args"].get(k)][:3]
    if diff:
        def said(args: dict) -> str:
            return ", ".join(f"{k}={args.get(k)}" for k in diff)

        raise ConversionSetupError(f"'{out}' is being converted with {said(found['args'])}; this command has "
                                   f"{said(plan['args'])} (every --stages command must convert the same model at "
                                   "the same layout and dtype)")


def finish(out: Path) -> bool:
    """Finish ``out`` when every stage is present (True when this call finished it): the rank
    folders and ``hf/`` renamed into place, the tracker written last, ``.stages/`` removed."""
    with _locked(out) as staging:
        if not staging or missing_stages(out) != []:
            return False
        release = out / "release"
        release.mkdir(exist_ok=True)
        for k in range(_plan(out)["pp"]):
            for rank in sorted(stage_dir(out, k).iterdir()):
                if (release / rank.name).exists():  # a finish that stopped half way, repeated
                    discard(release / rank.name)
                os.replace(rank, release / rank.name)
        if (out / "hf").exists():
            discard(out / "hf")
        os.replace(out / STAGING / "hf", out / "hf")
        fsync_path(release)
        tmp = out / f".{TRACKER}.{os.getpid()}"
        tmp.write_text("release\n")
        publish(tmp, out / TRACKER)
        discard(out / STAGING)  # the lock file with it: a waiter finds it gone, then the tracker
    fsync_path(out)
    return True
