"""A Megatron checkpoint converted a few pipeline stages at a time (``--stages``), by commands
that may run on several hosts at once, into one folder on a shared file system.

While stages are missing the folder holds ``.stages/``: ``plan.json`` (the checkpoint's args,
which every command must share: a command with another layout, dtype, format or model is
refused), ``hf/`` (the side folder, written once) and ``stage-KKK/`` for each stage converted,
renamed into place whole (toolkit.atomic): its ``release/`` files (legacy: its rank folders
``mp_rank_TT_KKK[_EEE]``; torch_dist: its own ``__K_i.distcp`` files) and, for torch_dist,
``chunks.json`` (what those files store where). Megatron's tracker
(``latest_checkpointed_iteration.txt``) is absent, and the readers refuse the folder naming the
missing stages (``check_finished``). The command that finds every stage present after its own
rename finishes the folder under ``.stages/lock`` (a POSIX record lock, which NFS honours,
dropped when its process ends however it ends): the files and ``hf/`` are renamed to their
places, torch_dist's common.pt, metadata.json and single ``.metadata`` written from the chunk
lists, the tracker written last, and ``.stages/`` removed. A legacy result holds exactly the
files, byte for byte, of the whole conversion; a torch_dist one the same tensors in other files.
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

from toolkit.atomic import atomic_output_dir, discard, fsync_path, publish, sync_tree
from toolkit.errors import OutputExistsError

from .errors import CheckpointError, ConversionSetupError

STAGING = ".stages"
PLAN = "plan.json"
CHUNKS = "chunks.json"  # a torch_dist stage's stored items, for the .metadata the finish writes
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


def finish(out: Path, complete=None) -> bool:
    """Finish ``out`` when every stage is present (True when this call finished it): the stages'
    files and ``hf/`` renamed into place, ``complete(release, chunk lists)`` (torch_dist: its
    .metadata), the tracker written last, ``.stages/`` removed."""
    with _locked(out) as staging:
        if not staging or missing_stages(out) != []:
            return False
        release, pp = out / "release", _plan(out)["pp"]
        release.mkdir(exist_ok=True)
        for k in range(pp):
            for p in sorted((stage_dir(out, k) / "release").iterdir()):
                if (release / p.name).exists():  # a finish that stopped half way, repeated
                    discard(release / p.name) if p.is_dir() else (release / p.name).unlink()
                os.replace(p, release / p.name)
        if complete is not None:
            complete(release, [json.loads((stage_dir(out, k) / CHUNKS).read_text()) for k in range(pp)])
        if (out / "hf").exists():
            discard(out / "hf")
        os.replace(out / STAGING / "hf", out / "hf")
        sync_tree(release)
        tmp = out / f".{TRACKER}.{os.getpid()}"
        tmp.write_text("release\n")
        publish(tmp, out / TRACKER)
        discard(out / STAGING)  # the lock file with it: a waiter finds it gone, then the tracker
    fsync_path(out)
    return True


def convert(out: Path, stages: range, mm, layout, targets: list, args: Any, source, *, fmt: str, grouped_gemm: bool,
            overwrite: bool, progress, workers: int, side) -> None:
    """Each stage's files (legacy: its rank folders; torch_dist: its .distcp files, named
    ``__K_i``, and their chunk list) written into a folder renamed whole to ``.stages/stage-KKK``;
    then ``finish``, which the command that completes the set carries out (torch_dist: DCP, which
    the .metadata needs, is imported while the files are written, as by a whole conversion)."""
    from .formats import torch_dist_write, torch_legacy
    from .jobs import run
    from .sharding import local_name
    from .stream import Meter

    begin(out, plan_of(args, layout.pp), stages, overwrite, side)

    def stage_of(name: str) -> int:  # a global name's (a torch_dist piece's, a linear module's .weight)
        return local_name(mm.shape, layout, name, grouped_gemm)[0]

    def target_stage(t) -> int:  # legacy: the rank tensor's own
        return t.name.pp if fmt == "torch" else stage_of(t.name.name)

    mine = [t for t in targets if target_stage(t) in stages]
    meter = Meter(sum(t.nbytes for t in mine), progress)
    for k in stages:
        with atomic_output_dir(stage_dir(out, k), overwrite) as tmp:
            if fmt == "torch":
                file_jobs = torch_legacy.jobs(tmp / "release", [t for t in mine if target_stage(t) == k], args, layout)
            else:
                (tmp / "release").mkdir()
                items = torch_dist_write.model_items(mm, mine, keep=lambda name, k=k: stage_of(name) == k)
                file_jobs, named = torch_dist_write.file_jobs(tmp / "release", items, workers, rank=k)
                (tmp / CHUNKS).write_text(json.dumps(torch_dist_write.records(named)))
            run(file_jobs, source, meter, workers)

    def complete(release: Path, chunk_lists: list[list]) -> None:
        torch_dist_write.complete(release, args, [r for chunks in chunk_lists for r in chunks])

    finish(out, None if fmt == "torch" else complete)
