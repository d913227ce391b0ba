"""Writing megatron's ``torch_dist`` format by streaming, with DCP's own metadata.

A torch_dist folder is what ``dist_checkpointing.save`` leaves: ``common.pt`` (args),
``metadata.json``, ``.distcp`` files and DCP's ``.metadata``. Each stored chunk (as
``GPTModel.sharded_state_dict()`` cuts it: one per layer on a stacked layer axis, one per
tensor-parallel piece, swiglu gate and up apart) is a whole torch.save file of one tensor
inside a ``.distcp``, exactly as DCP's FileSystemWriter stores it; each linear layer's
``_extra_state`` is a torch.save'd ``[None]`` (megatron's ShardedObject bytes). The files
are laid out first (``torch_zip``), filled chunk by chunk from the sources, and
``.metadata`` is built from DCP's classes (TensorStorageMetadata, ChunkStorageMetadata,
MetadataIndex, _StorageInfo) and written by DCP's ``FileSystemWriter.finish``, so
megatron-core's ``dist_checkpointing.load`` reads it at any layout, and nothing holds more
than a chunk buffer.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..jobs import FileJob
from ..sink import ChunkCRCs, FileWriter, write_target
from ..stream import Meter, Source, Target
from . import torch_zip
from .torch_dist import METADATA_JSON, NORM_KEYS, dist_key, part_key
from .torch_pickle import TensorSpec


@dataclass(frozen=True)
class Piece:
    """A chunk of a global tensor as one rank holds it: rows/cols of its 2-D view."""

    name: str
    row: int
    col: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Item:
    """One stored object: a tensor chunk (``target``) or a ShardedObject's bytes."""

    key: str
    offsets: tuple[int, ...] | None  # None: a bytes object
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    target: Target | None
    lay: torch_zip.ZipLayout

    @property
    def nbytes(self) -> int:
        return self.lay.size


def tensor_item(t: Target, global_shapes: dict[str, tuple[int, ...]], axis_sizes: dict[str, int],
                stacked: bool, norms: dict[str, str] = NORM_KEYS, parts: dict | None = None) -> Item:
    """A piece as megatron's ShardedTensor.from_rank_offsets stores it: leading layer/expert
    axes of size 1, then the piece's rows (and columns) at its offsets (``norms``: the
    spec's norm renames, torch_dist.norm_keys). A tensor of more than 2 dims is split by rows
    only (a conv1d weight). A PARTS-split tensor (``parts``: ModelMap.part_keys) is stored one
    key per part, as megatron's sharded_state_dict factories store it (gated delta nets)."""
    p: Piece = t.name
    key, axes = dist_key(p.name, stacked, norms)
    gshape = tuple(global_shapes[p.name])
    row = p.row
    if parts and p.name in parts:
        key, start, rows = part_key(key, parts[p.name], p.row)
        row, gshape = p.row - start, (rows, *gshape[1:])
    lead = tuple(i for _, i in axes)
    within = (row,) if len(p.shape) == 1 else (row, p.col) if len(gshape) == 2 else (row,) + (0,) * (len(gshape) - 1)
    offsets = lead + within
    sizes = (1,) * len(lead) + (tuple(p.shape) if len(gshape) <= 2 else (p.shape[0], *gshape[1:]))
    gshape = tuple(axis_sizes[k] for k, _ in axes) + gshape
    lay, _ = torch_zip.torch_file(TensorSpec(sizes, t.dtype))
    return Item(key, offsets, sizes, gshape, t, lay)


def object_item(module: str, stacked: bool, axis_sizes: dict[str, int], norms: dict[str, str] = NORM_KEYS) -> Item:
    """A linear layer's ``_extra_state`` (None without TE), under ShardedObject.unique_key."""
    key, axes = dist_key(f"{module}._extra_state", stacked, norms)
    shape = tuple(axis_sizes[k] for k, _ in axes) or (1,)
    offset = tuple(i for _, i in axes) or (0,)
    unique = f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"
    lay = torch_zip.layout_of_bytes(torch_zip.torch_bytes([None]))
    return Item(unique, None, (), (), None, lay)


def split_files(items: list[Item], files: int) -> list[list[Item]]:
    """Items over ``files`` files of about equal size (largest first onto the smallest);
    each file's bytes objects first, as DCP's writer orders them."""
    out: list[list[Item]] = [[] for _ in range(max(1, files))]
    sizes = [0] * len(out)
    for it in sorted(items, key=lambda i: (i.target is not None, -i.nbytes)):
        k = sizes.index(min(sizes))
        out[k].append(it)
        sizes[k] += it.nbytes
    return [f for f in out if f]


def write_distcp(path: Path, items: list[Item], source: Source, meter: Meter, writer: FileWriter) -> None:
    """One .distcp: every item's zip laid out at its offset, tensor records streamed in."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pending, base = [], 0
        for it in items:
            torch_zip.write_pieces(fd, base, it.lay)
            if it.target is not None:
                crc = ChunkCRCs()
                write_target(writer, fd, base + it.lay.data[0][0], it.target, source, meter, crc)
                pending.append((base, it.lay, crc))
            base += it.nbytes
        writer.flush()
        for b, lay, crc in pending:
            torch_zip.patch_crcs(fd, b, lay, [crc.value()])
    finally:
        writer.flush_quietly()
        os.close(fd)


def write_metadata(d: Path, files: list[tuple[str, list[Item]]]) -> None:
    """DCP's ``.metadata`` for these files, built from DCP's classes and written by its
    FileSystemWriter (the way ``dist_checkpointing.save`` finishes)."""
    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)
    from torch.distributed.checkpoint.storage import WriteResult

    state: dict[str, Any] = {}
    results = []
    for name, items in files:
        base = 0
        for it in items:
            if it.offsets is None:
                state[it.key] = BytesStorageMetadata()
                index = MetadataIndex(it.key)
            else:
                md = state.setdefault(it.key, TensorStorageMetadata(
                    TensorProperties(dtype=it.target.dtype.torch), torch.Size(it.global_shape), []))
                md.chunks.append(ChunkStorageMetadata(torch.Size(it.offsets), torch.Size(it.sizes)))
                index = MetadataIndex(it.key, it.offsets)
            results.append(WriteResult(index=index, size_in_bytes=it.nbytes,
                                       storage_data=_StorageInfo(name, base, it.nbytes)))
            base += it.nbytes
    FileSystemWriter(str(d), sync_files=False).finish(Metadata(state_dict_metadata=state), [results])


def file_jobs(d: Path, items: list[Item], files: int) -> tuple[list[FileJob], list[tuple[str, list[Item]]]]:
    """The .distcp file jobs (``files`` of them, for that many workers) and what each file
    holds, for ``write_metadata`` once they are written."""
    named = [(f"__0_{i}.distcp", part) for i, part in enumerate(split_files(items, files))]
    return [FileJob(d / name, sum(i.nbytes for i in part), _writer(part)) for name, part in named], named


def plan(d: Path, items: list[Item], args: Any, files: int) -> tuple[list[FileJob], Any]:
    """The .distcp file jobs (``files`` of them, for that many workers) and the step that
    completes the folder once they are written: common.pt, metadata.json, .metadata."""
    from .torch_legacy import CHECKPOINT_VERSION

    jobs, named = file_jobs(d, items, files)

    def finish() -> None:
        common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}
        (d / "common.pt").write_bytes(torch_zip.torch_bytes(common, "common"))
        (d / "metadata.json").write_text(json.dumps(METADATA_JSON))
        write_metadata(d, named)

    finish.prepare = import_dcp  # type: ignore[attr-defined]
    return jobs, finish


def import_dcp() -> None:
    import torch.distributed.checkpoint  # noqa: F401


def _writer(items: list[Item]):
    def write(path: Path, source: Source, meter: Meter, writer: FileWriter) -> None:
        write_distcp(path, items, source, meter, writer)

    return write
