"""safetensors files read and written in bounded pieces.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
data_offsets relative to the end of the header) and the raw data. Row ranges are read
either as a small memory map of just those rows (``window``: no copy; unmapped as soon as
the last view of it is dropped, so resident memory stays at what is being copied, where a
map of a whole multi-GB shard would keep every touched page resident) or with
``os.preadv`` into a reused buffer (``rows``). Writing the header first and then each
tensor in chunks streams a shard of any size.
"""
from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CorruptFileError, MissingTensorError
from ..regions import as_2d
from ..stream import Scratch

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
CODES = {v: k for k, v in DTYPES.items()}
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


@dataclass(frozen=True)
class TensorInfo:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file


def _corrupt(path: Path, why: str) -> CorruptFileError:
    return CorruptFileError(f"safetensors file '{path}' is truncated or corrupt: {why}")


def _entry(path: Path, name: str, v: dict, data_start: int, size: int) -> TensorInfo:
    if not isinstance(v, dict) or v.get("dtype") not in DTYPES:
        raise _corrupt(path, f"tensor '{name}' has no known dtype")
    shape, (begin, end) = tuple(int(x) for x in v["shape"]), v["data_offsets"]
    n = DTYPES[v["dtype"]].itemsize
    for d in shape:
        n *= d
    if end - begin != n:
        raise _corrupt(path, f"tensor '{name}' holds {end - begin} bytes for shape {list(shape)} ({n} expected)")
    if data_start + end > size:
        raise _corrupt(path, f"tensor '{name}' ends at byte {data_start + end} but the file has {size} bytes")
    return TensorInfo(path, DTYPES[v["dtype"]], shape, data_start + begin)


def read_header(path: Path) -> dict[str, TensorInfo]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _corrupt(path, f"only {size} bytes")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise _corrupt(path, f"header of {n} bytes does not fit in {size} bytes")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _corrupt(path, f"header is not JSON ({e.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    return {k: _entry(path, k, v, 8 + n, size) for k, v in header.items() if k != "__metadata__"}


def read_rows(fd: int, info: TensorInfo, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
    """Rows [start, stop) of the tensor's 2-D view, read with pread into ``out`` (a
    contiguous [stop - start, cols] tensor of the tensor's dtype)."""
    _, cols = as_2d(info.shape) if info.shape else (1, 1)
    row_bytes = cols * info.dtype.itemsize
    view, pos, offset = out.view(-1).view(torch.uint8).numpy(), 0, info.offset + start * row_bytes
    while pos < len(view):
        got = os.preadv(fd, [view[pos:]], offset + pos)
        if got <= 0:
            raise _corrupt(info.path, "unexpected end of file")
        pos += got
    return out


class Reader:
    """Tensors of a set of safetensors files by name; one open descriptor per file."""

    def __init__(self, tensors: dict[str, TensorInfo]):
        self.tensors = tensors
        self._fds: dict[Path, int] = {}
        self._scratch = Scratch()

    def meta(self, name):
        info = self.info(name)
        return info.shape, info.dtype

    def info(self, name) -> TensorInfo:
        if name not in self.tensors:
            raise MissingTensorError(f"missing tensor '{name}'")
        return self.tensors[name]

    def _fd(self, info: TensorInfo) -> int:
        if info.path not in self._fds:
            self._fds[info.path] = os.open(info.path, os.O_RDONLY)
        return self._fds[info.path]

    def rows(self, name, start: int, stop: int) -> torch.Tensor:
        """Valid until the next call (one reused buffer)."""
        info = self.info(name)
        out = self._scratch.take((stop - start, as_2d(info.shape)[1]), info.dtype)
        return read_rows(self._fd(info), info, start, stop, out)

    def _span(self, name, start: int, stop: int) -> tuple[TensorInfo, int, int]:
        """(info, absolute byte offset, byte count) of rows [start, stop) of a tensor."""
        info = self.info(name)
        _, cols = as_2d(info.shape) if info.shape else (1, 1)
        row = cols * info.dtype.itemsize
        return info, info.offset + start * row, (stop - start) * row

    def window(self, name, start: int, stop: int) -> memoryview | None:
        """The bytes of rows [start, stop) as a read-only map of just those pages, filled in
        one call (MAP_POPULATE: no page faults while they are copied and checksummed) and
        unmapped when the last view of it is dropped."""
        info, begin, n = self._span(name, start, stop)
        if n == 0:
            return None
        base = begin - begin % mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(self._fd(info), begin - base + n, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ,
                      offset=base)
        return memoryview(m)[begin - base:]

    def extent(self, name, start: int, stop: int) -> tuple[int, int]:
        """(fd, offset) of rows [start, stop) in their file."""
        info, begin, _ = self._span(name, start, stop)
        return self._fd(info), begin

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def header_bytes(entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> bytes:
    """The 8-byte length and JSON header for tensors stored back to back in this order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, shape, dtype in entries:
        n = dtype.itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text
