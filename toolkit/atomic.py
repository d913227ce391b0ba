"""Nothing half-written: outputs are built in a temporary sibling folder and renamed into
place at the end; existing data is replaced only when asked.

The temporary folder ``.NAME.partial-<pid>-<random>`` (tempfile.mkdtemp's suffix) holds a lock file (a POSIX record lock,
which the kernel drops when its process ends, however it ends, and which NFS honours)
while it is being written. A process killed outright (SIGKILL, a node failure) cannot
remove its folder; the next run for the same output finds partial folders whose lock is
free and removes them, saying so through the ``toolkit.atomic`` logger. SIGTERM and
SIGINT become an ``Interrupted`` exception under ``signals_raise()`` (the CLI's), so the
folder is removed on the way out.

Before the rename every file and folder in it is flushed to the disk (``fsync``), and the
parent folder after it: a rename can reach the disk before the data it publishes, so a node
that fails right after a conversion would otherwise leave a complete-looking folder of
empty or short files.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .errors import OutputExistsError

LOCK = ".lock"  # inside a partial folder, locked by the process writing it
TRASH = ".old-"  # ``.NAME.old-*``: a folder being deleted (``discard``)
SYNC_THREADS = 8  # fsyncs in flight: each waits for the disk, not the CPU
log = logging.getLogger(__name__)


def check_output_dir(path: str | Path, overwrite: bool) -> Path:
    p = Path(path)
    if p.exists() and not overwrite:
        raise OutputExistsError(f"output '{p}' already exists (pass --overwrite to replace it)")
    if p.exists() and not p.is_dir():
        raise OutputExistsError(f"output '{p}' exists and is not a folder")
    return p


def partial_prefix(final: Path) -> str:
    return f".{final.name}.partial-"


def lock_is_free(lock: Path) -> bool:
    """True when no process holds the lock (so the folder's writer is gone)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops a lock this process took


def remove_stale(final: Path) -> list[Path]:
    """Remove the partial folders of ``final`` whose writing process no longer runs; return
    them. A folder without a lock file (just being created, or left by an older version)
    is left alone: whether its writer runs cannot be told."""
    removed, mine = [], f"{partial_prefix(final)}{os.getpid()}-"
    for p in sorted(final.parent.glob(glob.escape(partial_prefix(final)) + "*")):
        # this process's own folders are skipped: POSIX locks never conflict within a process
        if p.is_dir() and not p.name.startswith(mine) and lock_is_free(p / LOCK):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            log.warning("removed '%s', left by an earlier run for '%s' that no longer runs", p, final)
    return removed


def _locked_partial(final: Path) -> tuple[Path, int]:
    """A new partial folder with its lock held (the lock file gets its name only once locked,
    so another process never sees it unlocked)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{partial_prefix(final)}{os.getpid()}-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the result is an ordinary folder
    fd = os.open(tmp / (LOCK + ".new"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    os.rename(tmp / (LOCK + ".new"), tmp / LOCK)
    return tmp, fd


@contextlib.contextmanager
def atomic_output_dir(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes `path`, on any error or interruption
    it is removed. Stale partial folders of `path` are removed first."""
    final = check_output_dir(path, overwrite).resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(final)
    tmp, lock_fd = _locked_partial(final)
    try:
        yield tmp
        (tmp / LOCK).unlink()
        sync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock_fd)
    if final.exists():
        trash = trash_folder(final)
        os.replace(final, trash / "old")
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_path(final.parent)


def trash_folder(final: Path) -> Path:
    """A new hidden folder beside `final` to move it into before deleting it: ``.NAME.old-*``."""
    return Path(tempfile.mkdtemp(prefix=f".{final.name}{TRASH}", dir=final.parent))


def discard(folder: Path) -> None:
    """Delete `folder` so that no part of it is ever seen under its name: it is renamed into a
    hidden trash folder first (one rename), then deleted there. A process killed half way through
    the deletion leaves the trash folder (``remove_trash`` clears it), never a half-deleted
    `folder` that a reader would take for a damaged one."""
    trash = trash_folder(folder)
    os.replace(folder, trash / "old")
    shutil.rmtree(trash, ignore_errors=True)


def remove_trash(parent: Path) -> list[Path]:
    """Remove the trash folders (``.NAME.old-*``) that a killed ``discard`` or replacement left in
    `parent`; returns them. Only for a folder one process at a time writes into."""
    found = sorted(p for p in parent.glob(f".*{TRASH}*") if p.is_dir())
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found


def publish(tmp: str | Path, final: str | Path) -> None:
    """Rename the finished file ``tmp`` to ``final`` once its bytes are on the disk, and the
    rename after it (for a folder of files: ``atomic_output_dir``)."""
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(Path(final).parent)


def fsync_path(path: str | Path) -> None:
    """Flush one file's or folder's data and metadata to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: Path) -> None:
    """fsync every file under ``root`` (a few at a time), then every folder, deepest first.
    Symbolic links are not followed."""
    files, folders = [], []
    for d, _, names in os.walk(root):
        folders.append(d)
        files += [p for p in (os.path.join(d, n) for n in names) if not os.path.islink(p)]
    with ThreadPoolExecutor(min(SYNC_THREADS, max(1, len(files)))) as pool:
        list(pool.map(fsync_path, files))
    for d in reversed(folders):
        fsync_path(d)


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` swallows it); ``exit_code`` is the shell's 128 + signal number."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {self.name}")


_held_across_forks: set[int] = set()


def hold_across_forks(signals) -> None:
    """Block these signals from just before every ``os.fork`` of this process until just after
    it (the kernel keeps one that comes meanwhile pending). Otherwise a handler that raises
    (``signals_raise``'s, the runtime's) may run inside logging's fork hooks, Python code whose
    exceptions Python drops: the signal is lost and the work goes on (a conversion with
    ``--workers`` exited 0 after SIGTERM; megatron's checkpoint writers lost a SIGINT). The
    hooks are C functions (no bytecode runs in them), added after logging's, so they run first
    before the fork and last after it; the pending signal's handler then runs in the code that
    called os.fork, and the child starts with none pending. Once per signal per process."""
    new = set(signals) - _held_across_forks
    if not new:
        return
    _held_across_forks.update(new)
    block = functools.partial(signal.pthread_sigmask, signal.SIG_BLOCK, new)
    unblock = functools.partial(signal.pthread_sigmask, signal.SIG_UNBLOCK, new)
    os.register_at_fork(before=block, after_in_parent=unblock, after_in_child=unblock)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGTERM and SIGINT raise Interrupted in the main thread while inside (a second
    signal is ignored, so the clean-up it triggers runs to the end)."""
    sigs = (signal.SIGTERM, signal.SIGINT)

    def handler(signum, frame):
        for s in sigs:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
