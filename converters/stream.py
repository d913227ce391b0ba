"""Streaming one destination tensor at a time, in bounded row chunks.

A writer asks for a Target's bytes chunk by chunk (at most CHUNK_BYTES each); each chunk
is assembled from row ranges read out of the source files, so the memory in use is a
few chunks, whatever the model size.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from .errors import ConversionSetupError, MissingTensorError, TensorShapeError
from .regions import Copy, as_2d

CHUNK_BYTES = 16 << 20


class Source(Protocol):
    def meta(self, name: Hashable) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype); raises MissingTensorError naming the tensor when absent."""

    def rows(self, name: Hashable, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the tensor's 2-D view (``regions.as_2d``)."""


@dataclass(frozen=True)
class Target:
    name: Hashable
    shape: tuple[int, ...]
    dtype: torch.dtype
    copies: tuple[Copy, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def covered(self) -> bool:
        rows, cols = as_2d(self.shape)
        return sum(c.area for c in self.copies) == rows * cols


def label(name: Hashable) -> str:
    """A tensor name for messages: HF names as they are, rank tensors with their rank."""
    if isinstance(name, tuple) and hasattr(name, "_fields"):
        return f"{name.name} (tp={name.tp} pp={name.pp} ep={name.ep} chunk={name.vp})"
    return str(name)


def check_sources(expected: dict[Hashable, tuple[int, ...]], source: Source) -> None:
    """Every expected source tensor exists with the expected shape (first problem raised)."""
    missing = []
    for name, shape in expected.items():
        try:
            got, _ = source.meta(name)
        except MissingTensorError:
            missing.append(label(name))
            continue
        if tuple(got) != tuple(shape):
            raise TensorShapeError(f"tensor '{label(name)}' has shape {list(got)}, expected {list(shape)}")
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise MissingTensorError(f"missing tensor{'s' if len(missing) > 1 else ''}: "
                                 f"{', '.join(missing[:3])}{more}")


def target_dtype(copies: list[Copy], source: Source, dtype: torch.dtype | None, name: Hashable) -> torch.dtype:
    """``dtype`` when asked; else the sources' own dtype (they must agree: no silent cast)."""
    if dtype is not None:
        return dtype
    found = {source.meta(c.src)[1] for c in copies}
    if len(found) != 1:
        raise ConversionSetupError(f"the sources of '{label(name)}' have dtypes {sorted(map(str, found))}; "
                                   "pass --dtype to choose one")
    return found.pop()


class Scratch:
    """A few grow-only byte buffers used in turn: fresh chunk-sized allocations would each be
    page-faulted in again. With ``ring`` buffers a chunk stays intact while the next
    ``ring - 1`` are made (a background writer may still hold it)."""

    def __init__(self, ring: int = 1):
        self.bufs = [torch.empty(0, dtype=torch.uint8) for _ in range(ring)]
        self.turn = 0

    def take(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        n = shape[0] * shape[1] * dtype.itemsize
        self.turn = (self.turn + 1) % len(self.bufs)
        if self.bufs[self.turn].numel() < n:
            self.bufs[self.turn] = torch.empty(n, dtype=torch.uint8)
        return self.bufs[self.turn][:n].view(dtype).view(shape)


_OUT = Scratch(ring=3)  # see sink.FileWriter: one chunk queued, one being written, one being made


def _whole_rows(c: Copy, src_cols: int, dst_cols: int) -> bool:
    return c.src_col == 0 and c.dst_col == 0 and c.cols == src_cols == dst_cols


def chunks(target: Target, source: Source, chunk_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
    """The target's rows, CHUNK_BYTES at a time, as contiguous 2-D tensors (each valid while
    the next two are made). Whole-row copies in the same dtype are read straight into the
    chunk when the source can (``read_into``); the rest goes through ``rows``."""
    rows, cols = as_2d(target.shape)
    step = max(1, chunk_bytes // max(1, cols * target.dtype.itemsize))
    copies = sorted(target.copies, key=lambda c: c.dst_row)
    direct = getattr(source, "read_into", None)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        buf = _OUT.take((r1 - r0, cols), target.dtype)
        if not target.covered:
            buf.zero_()
        for c in copies:
            a, b = max(r0, c.dst_row), min(r1, c.dst_row + c.rows)
            if a >= b:
                continue
            s0, s1 = c.src_row + a - c.dst_row, c.src_row + b - c.dst_row
            src_shape, src_dtype = source.meta(c.src)
            if direct and src_dtype == target.dtype and _whole_rows(c, as_2d(src_shape)[1], cols):
                direct(c.src, s0, s1, buf[a - r0:b - r0])
                continue
            buf[a - r0:b - r0, c.dst_col:c.dst_col + c.cols] = source.rows(c.src, s0, s1)[:, c.src_col:c.src_col + c.cols]
        yield buf


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class Meter:
    """Counts bytes written and reports them to an optional progress callback."""

    def __init__(self, total: int, progress: Progress | None):
        self.total, self.done, self.progress = total, 0, progress

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)
