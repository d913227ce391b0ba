"""Tensors that lie as contiguous bytes at known offsets of files: the one source type of
every conversion.

A safetensors shard, a legacy ``model_optim_rng.pt`` (a zip of stored records) and a
torch_dist ``.distcp`` (torch.save files back to back) all keep each tensor's bytes in
one place of one file; their readers only find out where (``TensorInfo``). Rows are then
read as a small memory map of just those rows (``window``: no copy, unmapped as soon as
the last view of it is dropped, so resident memory stays at what is being copied, where
a map of a whole multi-GB file would keep every touched page resident), or copied file
to file by the kernel from ``extent``.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

from toolkit.regions import as_2d

from .dtypes import DType
from .errors import MissingTensorError

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


@dataclass(frozen=True)
class TensorInfo:
    path: Path
    dtype: DType
    shape: tuple[int, ...]  # as the conversion sees it (its 2-D view is ``regions.as_2d``)
    offset: int  # absolute byte offset of the first element in the file

    @property
    def row_bytes(self) -> int:
        return (as_2d(self.shape)[1] if self.shape else 1) * self.dtype.itemsize


class OpenFiles:
    """One read-only descriptor per file, opened on first use and closed together."""

    def __init__(self):
        self._fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FileTensors(OpenFiles):
    """Tensors by name, each a TensorInfo; one open descriptor per file."""

    def __init__(self, tensors: dict[Hashable, TensorInfo], what: str = "checkpoint"):
        super().__init__()
        self.tensors = tensors
        self.what = what

    def info(self, name) -> TensorInfo:
        if name not in self.tensors:
            raise MissingTensorError(f"missing tensor '{name}'")
        return self.tensors[name]

    def meta(self, name) -> tuple[tuple[int, ...], DType]:
        info = self.info(name)
        return info.shape, info.dtype

    def window(self, name, start: int, stop: int) -> memoryview | None:
        """The bytes of rows [start, stop) as a read-only map of just those pages, filled in
        one call (MAP_POPULATE: no page faults while they are copied and checksummed) and
        unmapped when the last view of it is dropped."""
        info = self.info(name)
        begin, n = info.offset + start * info.row_bytes, (stop - start) * info.row_bytes
        if n == 0:
            return None
        base = begin - begin % mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(self.fd(info.path), begin - base + n, flags=mmap.MAP_SHARED | _POPULATE,
                      prot=mmap.PROT_READ, offset=base)
        return memoryview(m)[begin - base:]

    def extent(self, name, start: int, stop: int) -> tuple[int, int]:
        """(fd, offset) of rows [start, stop) in their file."""
        info = self.info(name)
        return self.fd(info.path), info.offset + start * info.row_bytes

