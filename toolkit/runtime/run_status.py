"""Where a run folder stands, from the file system alone (no torch; `toolkit status RUN_DIR`):
the last logged step of train.steps, its loss, the recent throughput, the latest complete
checkpoint, and whether the run is alive.

Alive: while a run trains, its rank 0 holds a lock (POSIX ``lockf``, which NFS passes to its
lock manager) on ``RUN/running.json``, a file that names the host, the process and the start;
a run that ends normally removes it. So the file with its lock held is a live run (on any
machine that shares the folder), the file with its lock free is one that was killed or crashed
(nothing releases a lock but the end of its process), and no file is a run that is not running.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ..atomic import lock_is_free
from ..errors import InputFileError, MissingInputError, OutputExistsError
from .checkpoint_folder import LATEST, incomplete_reason, newest_complete

RUNNING = "running.json"
METRICS = "metrics.jsonl"
RECENT = 20  # logged steps the throughput is averaged over
_held: dict[Path, int] = {}  # run folder -> the descriptor whose lock says the run is alive


def check_not_running(out: Path) -> None:
    """Every rank, before a run starts in `out`: refuse a folder a live run holds (a requeued
    job started while the old one still runs), in one line naming it."""
    path = out / RUNNING
    if _lock_held(path):
        owner = _owner(path) or {}
        raise OutputExistsError(f"run folder '{out}' belongs to a run that is still running ({owner.get('host')}, "
                                f"pid {owner.get('pid')}): stop it first, or --out another folder")


def hold(out: Path) -> None:
    """Rank 0, as training starts: write RUN/running.json and keep it locked until the process
    ends (or release() at a normal end)."""
    path = out / RUNNING
    if out in _held:  # an earlier run in this process that raised
        os.close(_held.pop(out))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a second live run on this folder fails here
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}).encode())
    _held[out] = fd


def release(out: Path) -> None:
    """A normal end: the file goes, then its lock (closing the descriptor)."""
    fd = _held.pop(out, None)
    if fd is not None:
        (out / RUNNING).unlink(missing_ok=True)
        os.close(fd)


def _lock_held(path: Path) -> bool:
    """A process holds the lock on `path` (a missing file: nobody)."""
    return path.is_file() and not lock_is_free(path)


@dataclass(frozen=True)
class RunStatus:
    folder: Path
    state: str  # "running" | "finished" | "stopped" (killed or crashed) | "not running"
    owner: dict | None  # running.json: host, pid, started (when the file is there)
    steps: int | None  # train.steps of the spec that runs (spec.yaml)
    last: dict | None  # the last metrics.jsonl record
    last_at: float | None  # when it was written (the file's modification time)
    tokens_per_s: float | None  # mean over the last RECENT logged steps
    step_time_s: float | None
    checkpoint: Path | None  # the latest complete checkpoint
    checkpoint_note: str | None  # why `latest` is not that one, when it is not

    def lines(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        out = [f"run: {self.folder}: {self._state_text(now)}"]
        if self.last is None:
            out.append("step: none logged yet")
        else:
            of = f"/{self.steps} ({100 * self.last['step'] / self.steps:.1f}%)" if self.steps else ""
            ago = f", logged {_duration(now - self.last_at)} ago" if self.last_at is not None else ""
            loss = self.last.get("loss")
            out.append(f"step: {self.last['step']}{of}{ago}; loss {'skipped' if loss is None else f'{loss:.4f}'}, "
                       f"lr {self.last.get('lr', float('nan')):.3e}")
        if self.tokens_per_s is not None:
            eta = ""
            if self.state == "running" and self.steps and self.last and self.step_time_s:
                eta = f"; about {_duration((self.steps - self.last['step']) * self.step_time_s)} to go"
            out.append(f"throughput: {self.tokens_per_s:,.0f} tokens/s, {self.step_time_s:.3g} s/step "
                       f"(mean of the last {RECENT} logged steps){eta}")
        note = f" ({self.checkpoint_note})" if self.checkpoint_note else ""
        out.append(f"checkpoint: {self.checkpoint if self.checkpoint else 'none complete yet'}{note}")
        return out

    def _state_text(self, now: float) -> str:
        if self.owner is None:
            if self.state == "not running" and self.last and self.steps:
                return f"not running (stopped after step {self.last['step']} of {self.steps}: --resume continues it)"
            return self.state
        where = f"{self.owner.get('host')}, pid {self.owner.get('pid')}"
        since = f", for {_duration(now - self.owner['started'])}" if "started" in self.owner else ""
        if self.state == "running":
            return f"running ({where}{since})"
        return f"stopped without finishing (killed or crashed: {where} holds it no more); continue with --resume"


def _duration(s: float) -> str:
    s = max(0.0, s)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def status(folder: Path) -> RunStatus:
    """The run folder's status; a path that is not there exits 3, a folder that is not a run's
    (neither metrics.jsonl nor spec.yaml) exits 1."""
    folder = Path(folder)
    if not folder.exists():
        raise MissingInputError(f"run folder '{folder}' does not exist")
    if not (folder / METRICS).is_file() and not (folder / "spec.yaml").is_file():
        raise InputFileError(f"'{folder}' is not a run folder (no {METRICS} or spec.yaml: a training run's --out)")
    steps, save_dir = _spec_values(folder)
    records = _records(folder / METRICS)
    recent = records[-RECENT:]
    owner = _owner(folder / RUNNING)
    alive = owner is not None and _lock_held(folder / RUNNING)
    last = records[-1] if records else None
    if alive:
        state = "running"
    elif owner is not None:
        state = "stopped"
    else:
        state = "finished" if last and steps and last["step"] >= steps else "not running"
    root = folder / save_dir
    checkpoint, note = _checkpoint(root)
    return RunStatus(folder, state, owner, steps, last, (folder / METRICS).stat().st_mtime if records else None,
                     _mean(r.get("tokens_per_s") for r in recent), _mean(r.get("step_time_s") for r in recent),
                     checkpoint, note)


def _spec_values(folder: Path) -> tuple[int | None, str]:
    """train.steps and train.save_dir of the spec that runs (spec.yaml), read with yaml alone."""
    spec = folder / "spec.yaml"
    if not spec.is_file():
        return None, "checkpoints"
    import yaml

    train = (yaml.safe_load(spec.read_text()) or {}).get("train") or {}
    return train.get("steps"), train.get("save_dir") or "checkpoints"


def _records(path: Path) -> list[dict]:
    """metrics.jsonl's records; a last line cut short (being written as it is read) is left out."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    out = []
    for n, line in enumerate(lines, 1):
        try:
            out.append(json.loads(line))
        except ValueError:
            if n < len(lines):
                raise InputFileError(f"{path}:{n}: not a JSON record") from None
    return out


def _owner(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text() or "{}")
    except FileNotFoundError:
        return None
    except ValueError:
        return {}


def _mean(values) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return sum(vals) / len(vals) if vals else None


def _checkpoint(root: Path) -> tuple[Path | None, str | None]:
    """The checkpoint `--resume` would take, and a note when `latest` names another."""
    if not root.is_dir():
        return None, None
    latest = root / LATEST
    if latest.is_file():
        named = root / latest.read_text().strip()
        reason = incomplete_reason(named) if named.is_dir() else "it is not there"
        if reason is None:
            return named, None
        newest = newest_complete(root, named)
        return newest, f"`latest` names '{named.name}', which is incomplete: {reason}"
    return newest_complete(root), None
