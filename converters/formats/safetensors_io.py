"""safetensors files: the header read (where each tensor's bytes lie) and written.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
data_offsets relative to the end of the header) and the raw data. Reading gives each
tensor's ``files.TensorInfo``; writing the header first and then each tensor in chunks
streams a shard of any size.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..dtypes import BY_SAFETENSORS, DType
from ..errors import CorruptFileError
from ..files import TensorInfo


def _corrupt(path: Path, why: str) -> CorruptFileError:
    return CorruptFileError(f"safetensors file '{path}' is truncated or corrupt: {why}")


def _entry(path: Path, name: str, v: dict, data_start: int, size: int) -> TensorInfo:
    if not isinstance(v, dict) or v.get("dtype") not in BY_SAFETENSORS:
        raise _corrupt(path, f"tensor '{name}' has no known dtype")
    shape, (begin, end) = tuple(int(x) for x in v["shape"]), v["data_offsets"]
    dtype = BY_SAFETENSORS[v["dtype"]]
    n = dtype.itemsize
    for d in shape:
        n *= d
    if end - begin != n:
        raise _corrupt(path, f"tensor '{name}' holds {end - begin} bytes for shape {list(shape)} ({n} expected)")
    if data_start + end > size:
        raise _corrupt(path, f"tensor '{name}' ends at byte {data_start + end} but the file has {size} bytes")
    return TensorInfo(path, dtype, shape, data_start + begin)


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


def header_bytes(entries: list[tuple[str, tuple[int, ...], DType]]) -> bytes:
    """The 8-byte length and JSON header for tensors stored back to back in this order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, shape, dtype in entries:
        n = dtype.itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype.safetensors, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text
