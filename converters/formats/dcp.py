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
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..dtypes import dtype_of
from ..errors import CorruptFileError
from ..files import OpenFiles

METADATA = ".metadata"
COPY_BYTES = 1 << 30  # bytes per copy_file_range call


class DCPError(CorruptFileError):
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


def read_plain_metadata(folder: Path):
    """The ``.metadata`` of a DCP folder read without torch (torch_unpickle's stand-ins: the same
    fields, dtypes as converters DTypes, sizes and offsets as tuples), for reading by byte
    range; a metadata naming objects only torch builds is read by ``read_metadata``, as is
    what ``select`` re-pickles (it keeps torch's own classes)."""
    from .torch_unpickle import NeedsTorch, load_pickle

    p = folder / METADATA
    if not p.is_file():
        raise DCPError(f"'{folder}' is not a torch_dist checkpoint (no {METADATA})")
    try:
        md = load_pickle(p.read_bytes(), str(p))
    except NeedsTorch:
        return read_metadata(folder)
    except CorruptFileError as e:
        raise DCPError(f"cannot read the DCP metadata of '{folder}': {e}") from None
    if type(md).__name__ != "Metadata" or not isinstance(getattr(md, "state_dict_metadata", None), dict) \
            or not isinstance(md.storage_data, dict):
        raise DCPError(f"cannot read the DCP metadata of '{folder}': it holds {type(md).__name__}, not a Metadata "
                       "with state_dict_metadata and storage_data")
    return md


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


# ---------------------------------------------------------------------------- reading by byte range
PIECE_BYTES = 1 << 26  # stored rows read per call when they do not go straight into the target
READAHEAD_BYTES = 1 << 26  # bytes per sendfile call of a readahead
READAHEAD_GAP = 1 << 20  # ranges of a file closer than this are read as one


class Reader(OpenFiles):
    """Parts of the global tensors of a DCP folder, read by byte range straight into the
    caller's tensors: for each stored chunk overlapping a megatron ShardedTensor's part, the
    rows it needs are read with ``os.preadv`` into the ShardedTensor's ``data`` (through a
    bounded host buffer and torch's ``copy_`` when only some columns are needed, the dtype
    differs or the data is not in host memory: a CUDA parameter). No tensor is
    decoded whole and no process group is used; where each chunk's bytes start inside its
    torch.save record is read once (pickle and zip directory only). What it reads is what
    megatron's ``dist_checkpointing.load`` reads for the same ShardedTensors, including
    ``allow_shape_mismatch`` (elements the checkpoint does not hold are zero).

    ``readahead`` lists the byte ranges a sequence of ``fill`` calls will read (nothing but
    record headers is read to know them) and has the kernel start reading them into the page
    cache, on a thread, while the caller does other work: the later ``fill`` calls then copy
    from memory what the disk has already delivered."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder
        md = read_metadata(folder)
        self.keys = {k: v for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
        self.storage = {(i.fqn, tuple(i.offset)): s for i, s in md.storage_data.items() if i.offset is not None}
        self._where: dict[tuple, tuple] = {}
        self._planned: list[tuple[int, int, int]] | None = None  # set while ``ranges`` lists reads
        self._readahead: threading.Thread | None = None
        self._stop = threading.Event()

    def ranges(self, requests) -> list[tuple[int, int, int]]:
        """(fd, offset, bytes) of every read ``fill(sh, rows)`` makes for each (sh, rows) of
        ``requests``, in order; nothing is read into or written to the tensors."""
        self._planned = []
        try:
            for sh, rows in requests:
                self.fill(sh, rows)
            return self._planned
        finally:
            self._planned = None

    def readahead(self, requests) -> int:
        """Read what ``fill`` will read for ``requests`` (see ``ranges``) into the page
        cache on a background thread (``cache``: in file order, no copy; pages the kernel
        drops under memory pressure are read again by ``fill``); a readahead still running
        is stopped first. Returns the bytes asked for."""
        wanted = merged_ranges(self.ranges(requests))
        self._stop_readahead()
        if hasattr(os, "sendfile") and wanted:
            self._readahead = threading.Thread(target=cache, args=(wanted, self._stop), daemon=True,
                                               name="dcp-readahead")
            self._readahead.start()
        return sum(n for _, _, n in wanted)

    def _stop_readahead(self) -> None:
        """Stop the readahead after the piece it is reading, done or not (an error, say)."""
        if self._readahead is not None:
            self._stop.set()
            self._readahead.join()
            self._readahead = None
            self._stop.clear()

    def close(self) -> None:
        self._stop_readahead()  # it reads with this reader's descriptors
        super().close()

    def fill(self, sh, rows: tuple[int, int] | None = None) -> None:
        """Read the part of the stored global tensor that ``sh`` (a megatron ShardedTensor
        with data, or a ShardedTensorFactory) describes into its data. ``rows``: only rows
        [start, stop) of the data's first dimension are read (a factory's parts that are views
        of its data: the rows of each part that fall in that range), the rest of the data is
        left as it is."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        if not isinstance(sh, ShardedTensorFactory):
            self._fill(sh, rows)
            return
        built = sh.build()
        parts = list(nested_values(built))
        storage = sh.data.untyped_storage().data_ptr()
        copies = any(p.data.untyped_storage().data_ptr() != storage for p in parts)
        for part in parts:
            self._fill(part, None if rows is None or copies else _part_rows(sh.data, part.data, rows))
        if copies and self._planned is None:
            merged = sh.merge_fn(_with_loaded(built))  # the factory's parts are copies: merge as megatron does
            sh.data.copy_(merged)

    def _fill(self, sh, rows: tuple[int, int] | None = None) -> None:
        import math

        import torch

        if sh.flattened_range is not None:
            raise DCPError(f"'{sh.key}' is requested as a flattened range; only whole local parts are read")
        md = self.keys.get(sh.key)
        if md is None:
            raise DCPError(f"'{self.folder}' holds no tensor '{sh.key}'")
        if not sh.allow_shape_mismatch and tuple(md.size) != tuple(sh.global_shape):
            raise DCPError(f"'{sh.key}' is {list(md.size)} in '{self.folder}', {list(sh.global_shape)} here")
        dst = sh.data.detach()[(None,) * sh.prepend_axis_num]
        lo = tuple(sh.global_offset)  # where dst's element 0 is
        hi = tuple(o + n for o, n in zip(lo, dst.shape))
        want, want_hi = list(lo), list(hi)  # the box read: all of dst, or its rows [rows)
        if rows is not None and sh.data.dim() > 0:
            d, (r0, r1) = sh.prepend_axis_num, rows
            if not 0 <= r0 <= r1 <= dst.shape[d]:
                raise DCPError(f"rows {list(rows)} of '{sh.key}', whose part has {dst.shape[d]}")
            if r0 == r1:
                return
            want[d], want_hi[d] = lo[d] + r0, lo[d] + r1
            dst_box = dst.narrow(d, r0, r1 - r0)
        else:
            dst_box = dst
        if sh.allow_shape_mismatch and tuple(md.size) != tuple(sh.global_shape) and self._planned is None:
            with torch.no_grad():
                dst_box.zero_()  # what only this layout has (vocabulary padding rows) starts at zero
        copied = 0
        for c in md.chunks:
            co, cs = tuple(c.offsets), tuple(c.sizes)
            a = tuple(max(x, y) for x, y in zip(want, co))
            b = tuple(min(x, y + s) for x, y, s in zip(want_hi, co, cs))
            if any(x >= y for x, y in zip(a, b)):
                continue
            copied += self._copy(sh.key, co, cs, md.properties.dtype, a, b, dst, lo)
        expected = math.prod(y - x for x, y in zip(want, want_hi))
        if not sh.allow_shape_mismatch and copied != expected:
            raise DCPError(f"'{self.folder}' holds {copied} of the {expected} elements of '{sh.key}' at "
                           f"offsets {list(want)}")

    def _copy(self, key: str, co: tuple, cs: tuple, dtype, a: tuple, b: tuple, dst, lo: tuple) -> int:
        """Elements [a, b) (global coordinates) of the chunk at offsets ``co`` into ``dst``
        (whose element 0 is at ``lo``); returns how many."""
        import itertools
        import math

        import torch

        fd, base = self._locate(key, co, cs, dtype)
        if base is None or not cs:  # a record this reader cannot address by bytes, or a scalar: decoded whole
            if self._planned is not None:
                fd, info = self._record(key, co)
                self._planned.append((fd, info.offset, info.length))
                return math.prod(y - x for x, y in zip(a, b))
            src = self._decode(key, co)
            region = tuple(slice(x - o, y - o) for x, y, o in zip(a, b, co))
            with torch.no_grad():
                dst[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, lo))].copy_(src[region])
            return math.prod(y - x for x, y in zip(a, b))
        if len(cs) == 1:  # a vector: one column
            cs, co, a, b, lo, dst = cs + (1,), co + (0,), a + (0,), b + (1,), lo + (0,), dst.unsqueeze(-1)
        lead, cols, item = len(cs) - 2, cs[-1], dtype.itemsize
        strides = [math.prod(cs[j + 1:]) for j in range(lead)]
        r0, r1, c0, c1 = a[lead] - co[lead], b[lead] - co[lead], a[-1] - co[-1], b[-1] - co[-1]
        d0, e0 = a[lead] - lo[lead], a[-1] - lo[-1]
        step = max(1, PIECE_BYTES // (cols * item))
        for idx in itertools.product(*(range(x, y) for x, y in zip(a[:lead], b[:lead]))):
            first = sum((i - o) * s for i, o, s in zip(idx, co, strides))
            plane = dst[tuple(i - o for i, o in zip(idx, lo))]
            for r in range(r0, r1, step):
                rows = min(r1, r + step) - r
                target = plane[d0 + r - r0:d0 + r - r0 + rows, e0:e0 + c1 - c0]
                at = base + (first + r * cols) * item
                if self._planned is not None:
                    self._planned.append((fd, at, rows * cols * item))
                elif c1 - c0 == cols and target.dtype == dtype and target.is_contiguous() and _host(target):
                    self._pread(fd, target, at)
                else:
                    buf = torch.empty((rows, cols), dtype=dtype)
                    self._pread(fd, buf, at)
                    with torch.no_grad():
                        target.copy_(buf[:, c0:c1])
        return math.prod(y - x for x, y in zip(a, b))

    def _pread(self, fd: int, t, at: int) -> None:
        import torch

        view = memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], at + done)
            if n <= 0:
                raise DCPError(f"'{self.folder}': a record ends {len(view) - done} bytes early (offset {at + done})")
            done += n

    def _record(self, key: str, co: tuple):
        info = self.storage.get((key, co))
        if info is None:
            raise DCPError(f"'{self.folder}' lists a chunk of '{key}' at {list(co)} but stores no bytes for it")
        return self.fd(self.folder / info.relative_path), info

    def _locate(self, key: str, co: tuple, cs: tuple, dtype) -> tuple[int, int | None]:
        """(fd, absolute offset of the chunk's first element), or (fd, None) for a record
        that is not one contiguous tensor of the metadata's shape and dtype as stored bytes."""
        if (key, co) not in self._where:
            fd, info = self._record(key, co)
            what = f"{self.folder / info.relative_path} ({key} chunk at {list(co)})"
            self._where[(key, co)] = (fd, record_start(fd, info, what, cs, dtype_of(dtype), contiguous=False))
        return self._where[(key, co)]

    def _decode(self, key: str, co: tuple):
        """The whole stored chunk, decoded (a record not stored as one contiguous tensor)."""
        import io

        import torch

        fd, info = self._record(key, co)
        data = os.pread(fd, info.length, info.offset)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def record_start(fd: int, info, what: str, sizes: tuple[int, ...], dtype, contiguous: bool = True) -> int | None:
    """Where the first element of a chunk's tensor lies in the data file: the record (a whole
    torch.save file at ``info.offset``) is read onto the meta device, pickle and zip directory
    only. It must hold a tensor of ``sizes`` and ``dtype`` (a converters DType); a record that
    does not hold it as one contiguous run of bytes gives None, or with ``contiguous`` an error."""
    from .torch_pickle import ByteRange, load_plain, stored

    if getattr(info, "transform_descriptors", None):
        raise DCPError(f"{what} is stored through DCP extensions {info.transform_descriptors}; "
                       "only plain records are read")
    t = load_plain(ByteRange(fd, info.offset, info.length), what)
    if tuple(t.shape) != tuple(sizes) or dtype_of(t.dtype) != dtype:
        raise DCPError(f"{what} holds {list(t.shape)} {dtype_of(t.dtype)}; the metadata says {list(sizes)} {dtype}")
    try:
        s = stored(t, what)
    except CorruptFileError:  # stored non-contiguous: the caller decodes it, or refuses
        if contiguous:
            raise
        return None
    if s.offset + s.dtype.nbytes(sizes) > info.length:
        raise DCPError(f"{what}: its bytes run past the record ({info.length} bytes)")
    return info.offset + s.offset


def _host(t) -> bool:
    """Whether the bytes of ``t`` can be read into by pointer: a plain CPU tensor. A device
    tensor (a CUDA parameter being loaded) is filled from a host buffer by torch's ``copy_``."""
    return t.device.type == "cpu"


def merged_ranges(ranges: list[tuple[int, int, int]], gap: int = READAHEAD_GAP) -> list[tuple[int, int, int]]:
    """(fd, offset, bytes) sorted by file and offset, ranges of a file less than ``gap`` apart
    joined: the order in which a disk reads them fastest."""
    out: list[list[int]] = []
    for fd, at, n in sorted(ranges):
        if n <= 0:
            continue
        if out and out[-1][0] == fd and at <= out[-1][1] + out[-1][2] + gap:
            out[-1][2] = max(out[-1][2], at + n - out[-1][1])
        else:
            out.append([fd, at, n])
    return [(fd, at, n) for fd, at, n in out]


def cache(ranges: list[tuple[int, int, int]], stop: threading.Event | None = None,
          piece: int = READAHEAD_BYTES) -> None:
    """Read each (fd, offset, bytes) range into the page cache and nowhere else:
    ``os.sendfile`` to /dev/null, which makes the kernel read the file's pages and copies no
    byte (``posix_fadvise(WILLNEED)`` asks for the same but read at a fraction of the disk's
    speed here). Stops at the first error or once ``stop`` is set: what it does not bring in is
    read later anyway."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        for fd, at, n in ranges:
            end = at + n
            while at < end:
                if stop is not None and stop.is_set():
                    return
                sent = os.sendfile(null, fd, at, min(piece, end - at))
                if sent <= 0:
                    break
                at += sent
    except OSError:
        return
    finally:
        os.close(null)


def _part_rows(whole, part, rows: tuple[int, int]) -> tuple[int, int] | None:
    """Rows [start, stop) of ``whole``'s first dimension as rows of ``part``, a view of a
    block of its rows (a factory's split, e.g. the gate and up halves of a gated fc1); None
    (read the part whole) when the part is not such a view."""
    if whole.dim() == 0 or part.dim() != whole.dim() or part.stride() != whole.stride() \
            or tuple(part.shape[1:]) != tuple(whole.shape[1:]):
        return None
    delta = part.storage_offset() - whole.storage_offset()
    if delta < 0 or delta % whole.stride(0):
        return None
    first = delta // whole.stride(0)
    if first + part.shape[0] > whole.shape[0]:
        return None
    start, stop = max(rows[0], first), min(rows[1], first + part.shape[0])
    return (start - first, stop - first) if start < stop else (0, 0)


def _with_loaded(built):
    """A factory's built state with each ShardedTensor replaced by its (loaded) data."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return dict_list_map_inplace(lambda v: v.data if isinstance(v, ShardedTensor) else v, built)
