"""Copies of rectangles between tensors, and their composition and inversion.

Every conversion here is a re-arrangement of rows and columns: fusing q/k/v or gate/up,
splitting over tensor-parallel ranks, padding the vocabulary. Each step is a list of
``Copy`` (a rectangle of a source tensor placed into a destination tensor, both seen as
2-D: a 1-D tensor of n values is n x 1). Steps compose (HF -> global Megatron -> rank
tensors) and invert (the reverse direction is never written by hand), so data moves
once, from the source files to the destination files, whatever the route.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Copy:
    src: Hashable
    dst: Hashable
    src_row: int
    src_col: int
    dst_row: int
    dst_col: int
    rows: int
    cols: int

    @property
    def area(self) -> int:
        return self.rows * self.cols


def whole(src: Hashable, dst: Hashable, rows: int, cols: int, src_row: int = 0, dst_row: int = 0,
          src_col: int = 0, dst_col: int = 0) -> Copy:
    return Copy(src, dst, src_row, src_col, dst_row, dst_col, rows, cols)


def as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the 2-D view: 1-D -> (n, 1); N-D -> (first dim, product of the rest)."""
    if len(shape) == 1:
        return shape[0], 1
    cols = 1
    for d in shape[1:]:
        cols *= d
    return shape[0], cols


def by_dst(copies: Iterable[Copy]) -> dict[Hashable, list[Copy]]:
    out: dict[Hashable, list[Copy]] = defaultdict(list)
    for c in copies:
        out[c.dst].append(c)
    return out


def invert(copies: Iterable[Copy]) -> list[Copy]:
    """Swap source and destination. Where several sources held the same rectangle
    (replicated norms on every tp rank, a tied output layer) the first one is kept."""
    seen, out = set(), []
    for c in copies:
        key = (c.src, c.src_row, c.src_col, c.rows, c.cols)
        if key in seen:
            continue
        seen.add(key)
        out.append(Copy(c.dst, c.src, c.dst_row, c.dst_col, c.src_row, c.src_col, c.rows, c.cols))
    return out


def _intersect(outer: Copy, inner: Copy) -> Copy | None:
    """outer: mid -> dst; inner: src -> mid. The part of outer that inner supplies, as src -> dst."""
    r0, r1 = max(outer.src_row, inner.dst_row), min(outer.src_row + outer.rows, inner.dst_row + inner.rows)
    c0, c1 = max(outer.src_col, inner.dst_col), min(outer.src_col + outer.cols, inner.dst_col + inner.cols)
    if r0 >= r1 or c0 >= c1:
        return None
    return Copy(inner.src, outer.dst,
                src_row=inner.src_row + r0 - inner.dst_row, src_col=inner.src_col + c0 - inner.dst_col,
                dst_row=outer.dst_row + r0 - outer.src_row, dst_col=outer.dst_col + c0 - outer.src_col,
                rows=r1 - r0, cols=c1 - c0)


def compose(outer: Iterable[Copy], supply: dict[Hashable, list[Copy]]) -> list[Copy]:
    """outer moves mid -> dst, ``supply`` (``by_dst`` of the inner copies) moves src -> mid;
    the result moves src -> dst directly. Parts of ``outer`` that no inner copy supplies are
    dropped (they stay zero: vocabulary padding)."""
    out = []
    for o in outer:
        for i in supply.get(o.src, ()):
            c = _intersect(o, i)
            if c is not None:
                out.append(c)
    return out


def rename(copies: Iterable[Copy], src=None, dst=None) -> list[Copy]:
    """Apply name functions to sources and/or destinations."""
    return [replace(c, src=src(c.src) if src else c.src, dst=dst(c.dst) if dst else c.dst) for c in copies]
