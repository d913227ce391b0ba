"""The zip container of a torch.save file, laid out before any tensor byte is written.

torch.save writes an uncompressed zip through miniz: ``<prefix>/data.pkl``,
``.format_version``, ``.storage_alignment``, ``byteorder``, one ``data/<key>`` record per
storage, ``version`` and ``.data/serialization_id``; every record's bytes start at a
multiple of 64 (an "FB" extra field in its local header pads it) and are followed by a
data descriptor holding its CRC-32. torch.load relies on exactly that geometry (onto the
meta device it computes where record i+1 starts from record i), so ``layout`` reproduces
it, zip64 fields included, computing every header and small record up front: the tensor
records are then filled in place by the streaming writer, in any order and from several
threads, and their CRC-32s patched into the descriptor and the central directory at the
end. The tests read the result with torch.load (plain, mmap and meta) and zipfile.
"""
from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field

from .torch_pickle import TensorSpec, dumps

ALIGN = 64  # torch's storage alignment (the .storage_alignment record)
_U32, _U16 = 0xFFFFFFFF, 0xFFFF
ZIP64_LIMIT = _U32  # sizes and offsets from here on are zip64 fields (a test lowers it)
_PAD_ID = 0x4246  # "FB": the padding extra field torch's writer uses
_DOS_DATE = (1 << 5) | 1  # 1980-01-01


@dataclass
class ZipLayout:
    """A zip file's bytes, relative to its start: ``pieces`` (offset, bytes) hold everything
    but the streamed records, whose (offset, size) are ``data``; ``crc_at[i]`` lists where
    the CRC-32 of data record i goes once known."""

    size: int = 0
    pieces: list[tuple[int, bytes]] = field(default_factory=list)
    data: list[tuple[int, int]] = field(default_factory=list)
    crc_at: list[tuple[int, int]] = field(default_factory=list)


def _zip64_extra(values: list[int]) -> bytes:
    return struct.pack("<HH", 1, 8 * len(values)) + b"".join(struct.pack("<Q", v) for v in values)


def _local_header(name: bytes, size: int, offset: int) -> bytes:
    """miniz's local header as torch's writer calls it: CRC and sizes in the data descriptor
    (flag bit 3), zip64 fields when the size or the header's offset passes 4 GiB, then the
    "FB" field padding the data start to a multiple of ALIGN (torch's getPadding)."""
    z64 = ([size, size] if size >= ZIP64_LIMIT else []) + ([offset] if offset >= ZIP64_LIMIT else [])
    extra = _zip64_extra(z64) if z64 else b""
    pad = -(offset + 30 + len(name) + len(extra) + 4) % ALIGN
    extra += struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad
    n = _U32 if size >= ZIP64_LIMIT else 0
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if z64 else 20, _flags(size), 0, 0, _DOS_DATE, 0, n, n,
                       len(name), len(extra)) + name + extra


def _flags(size: int) -> int:
    """UTF-8 names; a data descriptor follows every record but an empty one (as miniz writes)."""
    return 0x0808 if size else 0x0800


def _descriptor(size: int, offset: int, crc: int) -> bytes:
    """The data descriptor after a record (64-bit sizes under the same condition as miniz)."""
    if size == 0:
        return b""
    if size >= ZIP64_LIMIT or offset >= ZIP64_LIMIT:
        return struct.pack("<IIQQ", 0x08074B50, crc, size, size)
    return struct.pack("<IIII", 0x08074B50, crc, size, size)


def _central_entry(name: bytes, size: int, crc: int, offset: int) -> bytes:
    big_size, big_off = size >= ZIP64_LIMIT, offset >= ZIP64_LIMIT
    values = ([size, size] if big_size else []) + ([offset] if big_off else [])
    extra = _zip64_extra(values) if values else b""
    n = _U32 if big_size else size
    version = 45 if values else 20
    return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, version, version, _flags(size), 0, 0, _DOS_DATE, crc, n, n,
                       len(name), len(extra), 0, 0, 0, 0, _U32 if big_off else offset) + name + extra


def _end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    big = cd_offset >= ZIP64_LIMIT or cd_size >= ZIP64_LIMIT or count >= _U16
    out = b""
    if big:
        z64_at = cd_offset + cd_size
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
        out += struct.pack("<IIQI", 0x07064B50, 0, z64_at, 1)
    return out + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, _U16), min(count, _U16),
                             min(cd_size, _U32), min(cd_offset, _U32), 0)


def layout(records: list[tuple[str, bytes | int]]) -> ZipLayout:
    """A stored zip of these records, in order: bytes are written as given, an int is the
    size of a record streamed later (listed in ``data`` and ``crc_at``, in order)."""
    out, central, pos = ZipLayout(), [], 0
    for name, content in records:
        raw = name.encode()
        streamed = isinstance(content, int)
        size = content if streamed else len(content)
        crc = 0 if streamed else zlib.crc32(content)
        head = _local_header(raw, size, pos)
        tail = _descriptor(size, pos, crc)
        if streamed:
            out.pieces += [(pos, head)] + ([(pos + len(head) + size, tail)] if tail else [])
            out.data.append((pos + len(head), size))
        else:
            out.pieces.append((pos, head + content + tail))
        central.append((raw, size, crc, pos, pos + len(head) + size + 4, streamed))
        pos += len(head) + size + len(tail)
    cd_offset, cd = pos, b""
    for raw, size, crc, offset, crc_pos, streamed in central:
        if streamed:  # an empty record's CRC is 0 already, and it has no descriptor
            out.crc_at.append((crc_pos, cd_offset + len(cd) + 16) if size else ())
        cd += _central_entry(raw, size, crc, offset)
    out.pieces.append((cd_offset, cd + _end_records(len(central), cd_offset, len(cd))))
    out.size = cd_offset + len(out.pieces[-1][1])
    return out


def serialization_id() -> str:
    """torch.save's 40-digit ``.data/serialization_id`` (any unique string of digits)."""
    return "".join(f"{int.from_bytes(os.urandom(8), 'little'):020d}"[:20] for _ in range(2))


def torch_file(obj, prefix: str = "archive") -> tuple[ZipLayout, list[TensorSpec]]:
    """The layout of ``torch.save(obj)`` with TensorSpec placeholders for tensors, and the
    TensorSpecs in record order (record i's bytes go to ``layout.data[i]``)."""
    pkl, specs = dumps(obj)
    records: list[tuple[str, bytes | int]] = [
        (f"{prefix}/data.pkl", pkl), (f"{prefix}/.format_version", b"1"),
        (f"{prefix}/.storage_alignment", str(ALIGN).encode()), (f"{prefix}/byteorder", b"little")]
    records += [(f"{prefix}/data/{i}", s.nbytes) for i, s in enumerate(specs)]
    records += [(f"{prefix}/version", b"3\n"), (f"{prefix}/.data/serialization_id", serialization_id().encode())]
    return layout(records), specs


def torch_bytes(obj, prefix: str = "archive") -> bytes:
    """torch.save(obj) for an object without tensors (common.pt, a ShardedObject's bytes)."""
    lay, specs = torch_file(obj, prefix)
    if specs:
        raise ValueError("torch_bytes is for objects without tensors")
    buf = bytearray(lay.size)
    for off, data in lay.pieces:
        buf[off:off + len(data)] = data
    return bytes(buf)


def layout_of_bytes(data: bytes) -> ZipLayout:
    """A finished file (``torch_bytes``) as a layout with nothing left to stream."""
    return ZipLayout(size=len(data), pieces=[(0, data)])


def write_pieces(fd: int, base: int, lay: ZipLayout) -> None:
    """Every byte of the file but the streamed records, at ``base`` in ``fd``."""
    for off, data in lay.pieces:
        os.pwrite(fd, data, base + off)


def patch_crcs(fd: int, base: int, lay: ZipLayout, crcs: list[int]) -> None:
    """Write the streamed records' CRC-32s (in ``data`` order) where the zip keeps them."""
    for value, at in zip(crcs, lay.crc_at):
        packed = struct.pack("<I", value)
        for pos in at:
            os.pwrite(fd, packed, base + pos)
