"""PyTorch DCP folders (what megatron-core's torch_dist format stores its tensors in), handled
as files: which keys a folder holds, and new folders made of some of the entries of others.

A DCP folder is ``.metadata`` (a pickled ``torch.distributed.checkpoint.metadata.Metadata``:
per key its global size and chunks, per chunk the file, offset and length of its record) plus
data files of records, each a ``torch.save`` of one chunk. ``select`` writes a folder holding
the entries of several source folders that a predicate keeps: their records are copied byte
for byte by the kernel (``os.copy_file_range``) into one data file per source file and the
metadata is rewritten with the new offsets. No tensor is decoded, so the copy runs at disk
speed and holds no tensor in memory; what megatron's ``dist_checkpointing.load`` reads from
the result is exactly what it would have read from the sources.
"""
from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import InputFileError

METADATA = ".metadata"
COPY_BYTES = 1 << 30  # bytes per copy_file_range call


class DCPError(InputFileError):
    """A folder is not a readable DCP (torch_dist) checkpoint."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: object  # torch.dtype


def read_metadata(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader

    if not (folder / METADATA).is_file():
        raise DCPError(f"'{folder}' is not a torch_dist checkpoint (no {METADATA})")
    try:
        return FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # noqa: BLE001  (any unreadable metadata is a corrupt checkpoint)
        raise DCPError(f"cannot read the DCP metadata of '{folder}': {e}") from None


def tensors(folder: Path) -> dict[str, TensorInfo]:
    """{key: global shape and dtype} of every tensor in the folder."""
    md = read_metadata(folder)
    return {k: TensorInfo(tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if hasattr(v, "chunks")}


@dataclass(frozen=True)
class Source:
    folder: Path
    keep: Callable[[str], bool]  # on the DCP key


def select(sources: list[Source], out: Path, progress: Callable[[int], None] | None = None) -> int:
    """Write ``out/.metadata`` and ``out/__<s><f>.distcp``: the kept entries of every source.
    Returns the bytes copied; `progress(bytes)` after each record."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    entries, storage, copied, version = {}, {}, 0, None
    for s, src in enumerate(sources):
        md = read_metadata(src.folder)
        version = version or getattr(md, "version", None)
        entries.update({k: v for k, v in md.state_dict_metadata.items() if src.keep(k)})
        records = sorted(((idx, info) for idx, info in md.storage_data.items() if src.keep(idx.fqn)),
                         key=lambda r: (r[1].relative_path, r[1].offset))
        moved, n = _copy_records(src.folder, records, out, f"__{s}", progress)
        storage.update(moved)
        copied += n
    merged = Metadata(state_dict_metadata=entries, storage_data=storage, storage_meta=StorageMeta())
    if version is not None:
        merged.version = version
    with open(out / METADATA, "wb") as f:
        pickle.dump(merged, f)
    return copied


def _copy_records(folder: Path, records: list, out: Path, prefix: str,
                  progress: Callable[[int], None] | None) -> tuple[dict, int]:
    """Records (sorted by file and offset) appended to one output file per source file."""
    moved, total, files = {}, 0, {}
    try:
        for idx, info in records:
            name = f"{prefix}{Path(info.relative_path).stem}.distcp"
            if name not in files:
                files[name] = [os.open(folder / info.relative_path, os.O_RDONLY),
                               os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), 0]
            src_fd, dst_fd, pos = files[name]
            copy_range(src_fd, dst_fd, info.offset, pos, info.length)
            moved[idx] = replace(info, relative_path=name, offset=pos)
            files[name][2] = pos + info.length
            total += info.length
            if progress:
                progress(info.length)
    finally:
        for src_fd, dst_fd, _ in files.values():
            os.close(src_fd)
            os.close(dst_fd)
    return moved, total


def copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, n: int) -> None:
    """n bytes from src_off to dst_off, kernel-side where the file system allows it."""
    while n > 0:
        try:
            done = os.copy_file_range(src_fd, dst_fd, min(n, COPY_BYTES), src_off, dst_off)
        except OSError:  # another file system, or a kernel without it: through user space
            done = os.pwrite(dst_fd, os.pread(src_fd, min(n, 1 << 24), src_off), dst_off)
        if done <= 0:
            raise DCPError(f"short copy: {n} bytes left at offset {src_off}")
        src_off, dst_off, n = src_off + done, dst_off + done, n - done
