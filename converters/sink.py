"""Writing streamed chunks to files: a background thread does the pwrite so that the next
chunk is read from the source while this one goes to disk (on an I/O-bound machine the
two overlap instead of adding up)."""
from __future__ import annotations

import os
import queue
import threading
import zlib

from .stream import Meter, Source, Target, as_bytes, chunks


class FileWriter:
    """pwrite from one background thread; at most one chunk waits in the queue, which is
    what stream.Scratch's ring of three buffers allows."""

    def __init__(self):
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="converters-writer")
        self._thread.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fd, data, offset = item
            if fd is None:  # a flush marker
                data.set()
                continue
            try:
                while data and self._error is None:
                    n = os.pwrite(fd, data, offset)
                    data, offset = data[n:], offset + n
            except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
                self._error = e

    def write(self, fd: int, data, offset: int) -> None:
        if self._error is not None:
            raise self._error
        self._q.put((fd, memoryview(data), offset))

    def flush(self) -> None:
        """Wait until every queued write is done (before closing a file descriptor)."""
        done = threading.Event()
        self._q.put((None, done, 0))
        done.wait()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Wait for every queued write; raise the first error any of them met."""
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_target(writer: FileWriter, fd: int, offset: int, target: Target, source: Source, meter: Meter,
                 crc: bool = False) -> int:
    """Stream ``target`` to ``fd`` from ``offset``; returns its CRC-32 (0 unless asked)."""
    value = 0
    for chunk in chunks(target, source):
        b = as_bytes(chunk)
        if crc:
            value = zlib.crc32(b, value)
        writer.write(fd, b, offset)
        offset += len(b)
        meter.add(len(b))
    return value
