"""Output files, written by this process or by ``workers`` forked processes.

Every conversion ends as a list of files to write (``FileJob``: path, size, how), each
independent of the others (or of runs of tensors of one file, which its planner created at
full size first: HF shards when they are fewer than the workers). One process writes them
in turn with its writer threads; with
``workers`` > 1 the files are dealt out by size to that many forked processes, each with
its own writer threads, so that several disks or a fast NVMe array are not limited by one
process. Children report bytes written (for the progress callback) and their error, if
any, through a pipe; the first error stops the others, and the caller's clean-up (the
temporary output folder) runs in this process only.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit.atomic import hold_across_forks

from .errors import ConversionError
from .sink import FileWriter
from .stream import Meter, Source


@dataclass(frozen=True)
class FileJob:
    path: Path
    nbytes: int
    write: Callable[[Path, Source, Meter, FileWriter], None]


def assign(jobs: list[FileJob], workers: int) -> list[list[FileJob]]:
    """Jobs dealt out to at most ``workers`` lists of about equal bytes (largest first,
    each onto the least loaded), keeping their order inside each list."""
    parts: list[list[FileJob]] = [[] for _ in range(max(1, min(workers, len(jobs))))]
    loads = [0] * len(parts)
    order = {id(j): i for i, j in enumerate(jobs)}
    for j in sorted(jobs, key=lambda j: -j.nbytes):
        k = loads.index(min(loads))
        parts[k].append(j)
        loads[k] += j.nbytes
    return [sorted(p, key=lambda j: order[id(j)]) for p in parts if p]


def run(jobs: list[FileJob], source: Source, meter: Meter, workers: int = 1,
        meanwhile: Callable[[], None] | None = None) -> None:
    """Write every job's file; raises the first error (of any worker). ``meanwhile`` (such
    as importing what the step after needs) runs while the files are written: on a thread
    beside the writing, or in this process while the workers write; its errors are left to
    whoever needs its result."""
    parts = assign(jobs, workers)
    if len(parts) <= 1:
        side = threading.Thread(target=_quietly, args=(meanwhile,), daemon=True) if meanwhile else None
        if side is not None:
            side.start()
        with FileWriter() as writer:
            for j in jobs:
                j.write(j.path, source, meter, writer)
        if side is not None:
            side.join()
        return
    _run_forked(parts, source, meter, meanwhile)


def _quietly(fn: Callable[[], None] | None) -> None:
    """Run ``fn`` ignoring its errors: it only prepares (imports) for a later step, which
    raises the same error itself when it needs the result (see run)."""
    with contextlib.suppress(Exception):
        if fn is not None:
            fn()


class _PipeMeter(Meter):
    """A child's byte count, sent to the parent in steps of at least STEP bytes."""

    STEP = 64 << 20

    def __init__(self, fd: int):
        super().__init__(0, None)
        self.fd, self.unsent = fd, 0

    def add(self, n: int) -> None:
        self.unsent += n
        if self.unsent >= self.STEP:
            self.flush()

    def flush(self) -> None:
        if self.unsent:
            _send(self.fd, b"B", str(self.unsent).encode())
            self.unsent = 0


def _send(fd: int, kind: bytes, data: bytes) -> None:
    msg = kind + len(data).to_bytes(8, "little") + data
    while msg:
        msg = msg[os.write(fd, msg):]


def _die_with_parent(parent: int) -> None:
    """Linux: be killed when the parent dies (even by SIGKILL), so that no orphan goes on
    writing into a folder the next run removes as stale."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's pipe closing stops writes at the end
        return
    if os.getppid() != parent:  # the parent died before the call
        os._exit(1)


def _child(jobs: list[FileJob], source: Source, fd: int, parent: int) -> None:
    """A worker: write these files, report, and leave without running the parent's clean-up."""
    code = 1
    try:
        _die_with_parent(parent)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the parent handles interruptions
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        meter = _PipeMeter(fd)
        with FileWriter() as writer:
            for j in jobs:
                j.write(j.path, source, meter, writer)
        meter.flush()
        code = 0
    except BaseException as e:  # noqa: BLE001  (sent to the parent, which raises it)
        try:
            data = pickle.dumps(e)
        except Exception:  # noqa: BLE001
            data = pickle.dumps(ConversionError(f"{type(e).__name__}: {e}"))
        with contextlib.suppress(OSError):  # the parent is gone: nobody left to tell
            _send(fd, b"E", data)
    finally:
        os._exit(code)


def _run_forked(parts: list[list[FileJob]], source: Source, meter: Meter,
                meanwhile: Callable[[], None] | None) -> None:
    children: dict[int, int] = {}  # read end -> pid
    me = os.getpid()
    hold_across_forks((signal.SIGTERM, signal.SIGINT))  # the CLI's handler raises: not inside a fork hook
    try:
        for part in parts:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _child(part, source, w, me)
            os.close(w)
            children[r] = pid
        _quietly(meanwhile)  # after the forks: no child inherits a half-done import
        _collect(children, meter)
    except BaseException:
        for pid in children.values():
            with contextlib.suppress(ProcessLookupError):  # already exited
                os.kill(pid, signal.SIGKILL)
        raise
    finally:
        for r, pid in children.items():
            os.close(r)
            with contextlib.suppress(ChildProcessError):  # already reaped
                os.waitpid(pid, 0)


def _collect(children: dict[int, int], meter: Meter) -> None:
    """Read the children's messages until every pipe is closed; raise the first error."""
    sel = selectors.DefaultSelector()
    buffers = {r: b"" for r in children}
    for r in children:
        sel.register(r, selectors.EVENT_READ)
    open_ = set(children)
    while open_:
        for key, _ in sel.select():
            r = key.fd
            data = os.read(r, 1 << 16)
            if not data:
                sel.unregister(r)
                open_.discard(r)
                _check_exit(children[r], buffers[r])
                continue
            buffers[r] = _handle(buffers[r] + data, meter)


def _handle(buf: bytes, meter: Meter) -> bytes:
    """Apply the complete messages in ``buf``; return the incomplete rest."""
    while len(buf) >= 9:
        n = int.from_bytes(buf[1:9], "little")
        if len(buf) < 9 + n:
            break
        kind, data, buf = buf[:1], buf[9:9 + n], buf[9 + n:]
        if kind == b"B":
            meter.add(int(data))
        else:
            raise pickle.loads(data)
    return buf


def _check_exit(pid: int, rest: bytes) -> None:
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        code = os.waitstatus_to_exitcode(status)
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise ConversionError(f"a conversion worker {how} without reporting an error")
