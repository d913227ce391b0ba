"""Writing streamed chunks to files on background threads.

The calling thread makes chunk after chunk (``stream.pieces``: views into the sources, or
gathered into scratch buffers); ``WORKERS`` threads take them in turn and, for each,
compute its CRC-32 when asked (a zip record's) and write it at its offset, file to file
inside the kernel where its bytes lie in a source file (``KernelCopy``). The checksum and
the writes release the GIL, so on two cores the checksums, the writes and the making of
the next chunk overlap instead of adding up. Chunks finish in any order; a record's CRC-32 is
combined from its chunks' (``crc.crc32_concat``) once they are all written.
"""
from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Callable

try:  # the same CRC-32 as zlib's, about 7x faster (Intel ISA-L; it is a dependency)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without an isal wheel
    from zlib import crc32

from .crc import crc32_concat
from .stream import RING, Chunk, Meter, Source, Target, as_buffer, pieces

IOV_MAX = 1024  # the Linux limit on buffers per pwritev
WORKERS = RING - 2  # chunks alive at once (stream.RING): one per worker, one queued, one being made


class FileWriter:
    """Runs write jobs on WORKERS threads; at most one job waits in the queue."""

    def __init__(self, workers: int = WORKERS):
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._copy = KernelCopy()
        self._file_locks: dict[int, threading.Lock] = {}
        self._file_locks_guard = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"converters-writer-{i}")
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                job()  # a job after an error only releases its chunk
            except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
                if self._error is None:
                    self._error = e
            finally:
                job = None  # drop the chunk's views (and the source maps behind them) now
                self._q.task_done()

    def call(self, job: Callable[[], None]) -> None:
        if self._error is not None:
            raise self._error
        self._q.put(job)

    def write(self, fd: int, data, offset: int, crcs: ChunkCRCs | None = None) -> None:
        """pwrite ``data`` (bytes-like, or a ``stream.Chunk``, released once written) at
        ``offset``; with ``crcs``, its CRC-32 goes into the next slot of ``crcs``."""
        chunk = data if isinstance(data, Chunk) else Chunk([memoryview(data).cast("B")])
        slot = None if crcs is None else crcs.reserve()

        def job() -> None:
            try:
                if self._error is not None:
                    return
                if slot is not None:
                    value = 0
                    for v in chunk.views:
                        value = crc32(as_buffer(v), value)
                    crcs.fill(slot, value, chunk.nbytes)
                with self._file_lock(fd):
                    self._copy.write(fd, chunk, offset)
                if slot is not None:
                    crcs.written(slot)
            finally:
                chunk.release()

        try:
            self.call(job)
        except BaseException:
            chunk.release()
            raise

    def _file_lock(self, fd: int) -> threading.Lock:
        """One writer at a time per file: a filesystem takes the file's own lock for each
        buffered write (ext4: the inode's rw-semaphore, which a second writer spins on,
        burning a core), so two threads writing one file gain nothing; they checksum in
        parallel and take turns writing, and threads on different files do not wait."""
        with self._file_locks_guard:
            return self._file_locks.setdefault(fd, threading.Lock())

    def flush(self) -> None:
        """Wait until every queued job is done (before reading CRCs or closing a file)."""
        self._q.join()
        if self._error is not None:
            raise self._error

    def flush_quietly(self) -> None:
        """Wait for the queued jobs without raising (before closing a file on an error path,
        so that no job writes to a closed, perhaps reused, descriptor)."""
        self._q.join()

    def close(self) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ChunkCRCs:
    """CRC-32s of one record's chunks, filled by the writer threads in any order."""

    def __init__(self):
        self._parts: list[tuple[int, int] | None] = []
        self._written: list[int] = []  # slots whose chunk is written (appended by the writer threads)

    def reserve(self) -> int:
        self._parts.append(None)
        return len(self._parts) - 1

    def fill(self, slot: int, crc: int, length: int) -> None:
        self._parts[slot] = (crc, length)

    def written(self, slot: int) -> None:
        self._written.append(slot)

    def complete(self) -> bool:
        """Every chunk reserved so far is checksummed and written (no flush needed)."""
        return len(self._written) == len(self._parts)

    def value(self) -> int:
        """The record's CRC-32 (after FileWriter.flush: every chunk's is in)."""
        if any(p is None for p in self._parts):
            raise RuntimeError("a chunk's CRC-32 is missing: read value() after FileWriter.flush()")
        return crc32_concat(self._parts)


class KernelCopy:
    """Writes a chunk: the parts that lie in a source file are copied file to file inside
    the kernel (copy_file_range, as ``cp`` does: the bytes never pass through user space
    and the page cache is filled the cheap way), the rest with pwritev. Where the kernel
    cannot copy between the two files (different filesystems: EXDEV; or no support), the
    first refusal switches this writer to pwritev for good."""

    REFUSED = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM)

    def __init__(self):
        self.enabled = hasattr(os, "copy_file_range")

    def write(self, fd: int, chunk: Chunk, offset: int) -> None:
        batch: list[memoryview] = []
        start = offset
        for view, where in zip(chunk.views, chunk.extents or [None] * len(chunk.views)):
            if where is not None and self.enabled:
                pwritev_all(fd, batch, start)
                batch, start = [], offset
                if self._copy(where, fd, offset, view.nbytes):
                    offset += view.nbytes
                    start = offset
                    continue
            batch.append(as_buffer(view))
            offset += view.nbytes
        pwritev_all(fd, batch, start)

    def _copy(self, where: tuple[int, int], fd: int, offset: int, n: int) -> bool:
        src, pos = where
        done = 0
        while done < n:
            try:
                got = os.copy_file_range(src, fd, n - done, pos + done, offset + done)
            except OSError as e:
                if done == 0 and e.errno in self.REFUSED:
                    self.enabled = False
                    return False
                raise
            if got == 0:
                raise OSError(errno.EIO, f"source file ended {n - done} bytes early while copying")
            done += got
        return True


def pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Write every view back to back from ``offset`` (pwritev, resumed after short writes)."""
    pending = [v for v in views if v.nbytes]
    while pending:
        n = os.pwritev(fd, pending[:IOV_MAX], offset)
        offset += n
        while n and pending:
            if n >= pending[0].nbytes:
                n -= pending.pop(0).nbytes
            else:
                pending[0], n = pending[0][n:], 0


def write_target(writer: FileWriter, fd: int, offset: int, target: Target, source: Source, meter: Meter,
                 crcs: ChunkCRCs | None = None) -> None:
    """Queue ``target``'s chunks for writing to ``fd`` from ``offset``; with ``crcs``, each
    chunk's CRC-32 lands there (``crcs.value()`` after ``writer.flush()``)."""
    for chunk in pieces(target, source):
        n = chunk.nbytes
        writer.write(fd, chunk, offset, crcs)
        offset += n
        meter.add(n)
    queued = getattr(source, "queued", None)
    if queued is not None:
        queued(writer)
