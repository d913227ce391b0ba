"""Writing streamed chunks to files from a background thread, so the next chunk is read
and assembled while this one is checksummed and written (on two cores, or an I/O-bound
disk, the two overlap instead of adding up)."""
from __future__ import annotations

import os
import queue
import threading
import zlib
from collections.abc import Callable

from .stream import Meter, Source, Target, as_bytes, chunks


class FileWriter:
    """Runs pwrite / CRC-32 jobs in order on one thread. At most one chunk waits in the
    queue, which is what stream.Scratch's ring of three buffers allows."""

    def __init__(self):
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self.crc = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="converters-writer")
        self._thread.start()

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            if self._error is None:
                try:
                    job()
                except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
                    self._error = e

    def call(self, job: Callable[[], None]) -> None:
        if self._error is not None:
            raise self._error
        self._q.put(job)

    def write(self, fd: int, data, offset: int, crc: bool = False) -> None:
        """pwrite ``data`` at ``offset``; with ``crc``, fold it into ``self.crc`` first."""
        view = memoryview(data)

        def job() -> None:
            if crc:
                self.crc = zlib.crc32(view, self.crc)
            pos, rest = offset, view
            while rest:
                n = os.pwrite(fd, rest, pos)
                pos, rest = pos + n, rest[n:]

        self.call(job)

    def flush(self) -> None:
        """Wait until every queued job is done (before closing a file descriptor)."""
        done = threading.Event()
        self.call(done.set)
        done.wait()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_target(writer: FileWriter, fd: int, offset: int, target: Target, source: Source, meter: Meter,
                 crc: bool = False) -> None:
    """Stream ``target`` to ``fd`` from ``offset``; with ``crc`` its CRC-32 accumulates in
    ``writer.crc`` (reset it first; read it after a job queued behind these)."""
    for chunk in chunks(target, source):
        b = as_bytes(chunk)
        writer.write(fd, b, offset, crc)
        offset += len(b)
        meter.add(len(b))
