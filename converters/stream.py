"""Streaming one destination tensor at a time, in bounded row chunks.

A writer asks for a Target's bytes chunk by chunk (at most CHUNK_BYTES of rows each); each
chunk is a few byte views, straight into the source files where whole rows move unchanged
and gathered from row ranges of the sources otherwise, so the memory in use is a few
chunks, whatever the model size. Bytes are bytes here (numpy); torch is imported only to
cast between dtypes.
"""
from __future__ import annotations

import queue
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import numpy as np

from toolkit.regions import Copy, as_2d

from .dtypes import DType
from .errors import ConversionSetupError, MissingTensorError, TensorShapeError

CHUNK_BYTES = 16 << 20


class Source(Protocol):
    def meta(self, name: Hashable) -> tuple[tuple[int, ...], DType]:
        """(shape, dtype); raises MissingTensorError naming the tensor when absent."""

    def window(self, name: Hashable, start: int, stop: int) -> memoryview | None:
        """The bytes of rows [start, stop) of the tensor's 2-D view (``regions.as_2d``), valid
        as long as the view is referenced (None for no bytes). A source may also offer
        ``extent(name, start, stop)``: where those bytes lie in a file, (fd, offset), so the
        kernel can copy them file to file, and ``queued(writer)``, called once a target's
        chunks are all queued on the sink.FileWriter ``writer`` (a source of very many files
        may ``writer.flush()`` there and close them)."""


@dataclass(frozen=True)
class Target:
    name: Hashable
    shape: tuple[int, ...]
    dtype: DType
    copies: tuple[Copy, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(self.shape)

    @property
    def covered(self) -> bool:
        rows, cols = as_2d(self.shape)
        return sum(c.area for c in self.copies) == rows * cols


def label(name: Hashable) -> str:
    """A tensor name for messages: HF names as they are, rank tensors with their rank."""
    if isinstance(name, tuple) and hasattr(name, "_fields"):
        return f"{name.name} (tp={name.tp} pp={name.pp} ep={name.ep} chunk={name.vp})"
    return str(name)


def check_sources(expected: dict[Hashable, tuple[int, ...]],
                  meta: Callable[[Hashable], tuple[tuple[int, ...], DType]]) -> None:
    """Every expected source tensor exists with the expected shape (first problem raised);
    ``meta`` is a source's (shape, dtype) lookup."""
    missing = []
    for name, shape in expected.items():
        try:
            got, _ = meta(name)
        except MissingTensorError:
            missing.append(label(name))
            continue
        if tuple(got) != tuple(shape):
            raise TensorShapeError(f"tensor '{label(name)}' has shape {list(got)}, expected {list(shape)}")
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise MissingTensorError(f"missing tensor{'s' if len(missing) > 1 else ''}: "
                                 f"{', '.join(missing[:3])}{more}")


def target_dtype(copies: list[Copy], source: Source, dtype: DType | None, name: Hashable) -> DType:
    """``dtype`` when asked; else the sources' own dtype (they must agree: no silent cast)."""
    if dtype is not None:
        return dtype
    found = {source.meta(c.src)[1] for c in copies}
    if len(found) != 1:
        raise ConversionSetupError(f"the sources of '{label(name)}' have dtypes {sorted(map(str, found))}; "
                                   "pass --dtype to choose one")
    return found.pop()


class Lease:
    """A pool buffer lent to one chunk, as [rows, row bytes] uint8; ``release`` gives it back
    (once written)."""

    def __init__(self, pool: ScratchPool | None, index: int, buf: np.ndarray | None):
        self.pool, self.index, self.buf = pool, index, buf

    def release(self) -> None:
        if self.pool is not None:
            self.pool._free.put(self.index)
            self.pool, self.buf = None, None


class ScratchPool:
    """A fixed number of grow-only byte buffers, lent one per chunk until the chunk is
    written: bounded memory, and no page faults for fresh allocations. ``take`` waits while
    every buffer is out (the writer threads give them back)."""

    def __init__(self, count: int):
        self._bufs = [np.empty(0, dtype=np.uint8) for _ in range(count)]
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(count):
            self._free.put(i)

    def take(self, rows: int, row_bytes: int) -> Lease:
        i = self._free.get()
        n = rows * row_bytes
        if self._bufs[i].size < n:
            self._bufs[i] = np.empty(n, dtype=np.uint8)
        return Lease(self, i, self._bufs[i][:n].reshape(rows, row_bytes))


RING = 4  # chunks alive at once: sink.WORKERS being written, one queued, one being made
_POOL = ScratchPool(RING)


class Lazy:
    """Bytes of a source file not mapped yet: their size, and how to map them. A chunk part
    the kernel copies file to file (``extent``) is never mapped at all; one that must be
    checksummed or written from memory is mapped by the writer thread that needs it."""

    __slots__ = ("nbytes", "_open", "_view")

    def __init__(self, nbytes: int, open_: Callable[[], memoryview]):
        self.nbytes, self._open, self._view = nbytes, open_, None

    def view(self) -> memoryview:
        if self._view is None:
            self._view = self._open()
        return self._view


def as_buffer(v: memoryview | Lazy) -> memoryview:
    return v.view() if isinstance(v, Lazy) else v


@dataclass
class Chunk:
    """Consecutive bytes of a target, as views to write back to back; ``release()`` once
    written (gives the scratch buffer, if any, back to the pool). ``extents[i]``, when not
    None, says where view i lies in a source file, (fd, offset): the kernel can copy it
    from there (copy_file_range) without the bytes passing through user space."""

    views: list[memoryview | Lazy]
    lease: Lease | None = None
    extents: list[tuple[int, int] | None] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
        self.views, self.extents = [], []


def _whole_rows(c: Copy, src_cols: int, dst_cols: int) -> bool:
    return c.src_col == 0 and c.dst_col == 0 and c.cols == src_cols == dst_cols


def pieces(target: Target, source: Source, chunk_bytes: int | None = None) -> Iterator[Chunk]:
    """The target's bytes in order, CHUNK_BYTES of rows at a time (release each chunk once
    written: at most RING chunks are out at once).

    Rows that one whole-row copy supplies in the target's dtype are views straight into the
    source (``window``: a memory map of just those bytes of its file; with ``extent`` the
    kernel copies them into the destination file, no copy in user space). The other rows (column slices of
    row-parallel splits, dtype casts, vocabulary padding) are gathered into a pool buffer.
    """
    rows, cols = as_2d(target.shape)
    step = max(1, (chunk_bytes or CHUNK_BYTES) // max(1, cols * target.dtype.itemsize))
    copies = sorted(target.copies, key=lambda c: c.dst_row)
    extent = getattr(source, "extent", None)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        direct: list[tuple[int, int, memoryview | Lazy, tuple[int, int] | None]] = []
        gather: list[tuple[Copy, int, int]] = []
        for c in copies:
            a, b = max(r0, c.dst_row), min(r1, c.dst_row + c.rows)
            if a >= b:
                continue
            src_shape, src_dtype = source.meta(c.src)
            if src_dtype == target.dtype and _whole_rows(c, as_2d(src_shape)[1], cols):
                s0, s1 = c.src_row + a - c.dst_row, c.src_row + b - c.dst_row
                if extent is not None and s1 > s0:
                    lazy = Lazy((s1 - s0) * cols * src_dtype.itemsize, partial(source.window, c.src, s0, s1))
                    direct.append((a, b, lazy, extent(c.src, s0, s1)))
                    continue
                view = source.window(c.src, s0, s1)
                if view is not None:
                    direct.append((a, b, view, None))
                    continue
            gather.append((c, a, b))
        chunk, pos = Chunk([]), r0
        try:
            for a, b, view, where in direct + [(r1, r1, None, None)]:
                if pos < a:  # rows [pos, a) come from the scratch buffer
                    if chunk.lease is None:
                        chunk.lease = _POOL.take(r1 - r0, cols * target.dtype.itemsize)
                    buf = chunk.lease.buf[pos - r0:a - r0]
                    _gather(buf, target.dtype, pos, a, gather, source)
                    chunk.views.append(memoryview(buf).cast("B"))
                    chunk.extents.append(None)
                if view is not None:
                    chunk.views.append(view)
                    chunk.extents.append(where)
                pos = max(pos, b)
        except BaseException:
            chunk.release()
            raise
        yield chunk


def _gather(buf: np.ndarray, dtype: DType, r0: int, r1: int, gather: list[tuple[Copy, int, int]],
            source: Source) -> None:
    """Target rows [r0, r1) into ``buf`` ([rows, row bytes]): the parts of ``gather`` that
    fall there, zeros elsewhere. Bytes are copied as they are; only a part in another dtype
    goes through torch (a cast)."""
    size = dtype.itemsize
    parts = [(c, max(r0, a), min(r1, b)) for c, a, b in gather if max(r0, a) < min(r1, b)]
    if sum((b - a) * c.cols * size for c, a, b in parts) != buf.size:
        buf.fill(0)
    for c, a, b in parts:
        s0, s1 = c.src_row + a - c.dst_row, c.src_row + b - c.dst_row
        src_shape, src_dtype = source.meta(c.src)
        view = source.window(c.src, s0, s1)
        src = np.frombuffer(view, dtype=np.uint8).reshape(s1 - s0, -1)
        dst = buf[a - r0:b - r0, c.dst_col * size:(c.dst_col + c.cols) * size]
        if src_dtype == dtype:
            dst[:] = src[:, c.src_col * size:(c.src_col + c.cols) * size]
        else:
            dst[:] = cast(src[:, c.src_col * src_dtype.itemsize:(c.src_col + c.cols) * src_dtype.itemsize],
                          src_dtype, dtype)
        del src, view


def cast(data: np.ndarray, src: DType, dst: DType) -> np.ndarray:
    """[rows, cols * src.itemsize] bytes of ``src`` values as bytes of ``dst`` values
    (torch's rounding, as ``Tensor.to``)."""
    import torch

    t = torch.from_numpy(data.copy()).view(src.torch).to(dst.torch)  # a writable, contiguous copy
    return t.view(torch.uint8).numpy().reshape(data.shape[0], -1)


Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class Meter:
    """Counts bytes written and reports them to an optional progress callback."""

    def __init__(self, total: int, progress: Progress | None):
        self.total, self.done, self.progress = total, 0, progress

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)
