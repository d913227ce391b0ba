"""Writing megatron's ``torch_dist`` format by streaming, with DCP's own metadata.

A torch_dist folder is what ``dist_checkpointing.save`` leaves: ``common.pt`` (args),
``metadata.json``, ``.distcp`` files and DCP's ``.metadata``. Each stored chunk (as
``GPTModel.sharded_state_dict()`` cuts it: one per layer on a stacked layer axis, one per
tensor-parallel piece, swiglu gate and up apart) is a whole torch.save file of one tensor
inside a ``.distcp``, exactly as DCP's FileSystemWriter stores it; each linear layer's
``_extra_state`` is a torch.save'd ``[None]`` (megatron's ShardedObject bytes). The files
are laid out first (``torch_zip``), filled chunk by chunk from the sources, and
``.metadata`` is what DCP's ``FileSystemWriter.finish`` writes, byte for byte, pickled
without torch (converters.formats.dcp_pickle), so megatron-core's ``dist_checkpointing.load``
reads it at any layout, and nothing holds more than a chunk buffer.
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


def records(files: list[tuple[str, list[Item]]]) -> list[list]:
    """What ``.metadata`` says of each stored item, in file order, as plain data (a staged
    conversion's chunk list, converters.staged): [file, key, offsets or None, sizes, global
    shape, dtype name or None, bytes]."""
    return [[name, it.key, it.offsets, it.sizes, it.global_shape,
             None if it.target is None else it.target.dtype.name, it.nbytes] for name, items in files for it in items]


def write_metadata(d: Path, stored: list[list]) -> None:
    """DCP's ``.metadata`` for these ``records``, byte for byte what DCP's FileSystemWriter
    writes (the way ``dist_checkpointing.save`` finishes), pickled without torch
    (converters.formats.dcp_pickle)."""
    from .dcp_pickle import write_metadata as write

    write(d, stored)


def file_jobs(d: Path, items: list[Item], files: int,
              rank: int = 0) -> tuple[list[FileJob], list[tuple[str, list[Item]]]]:
    """The .distcp file jobs (``files`` of them, for that many workers; named ``__RANK_i``, as
    DCP names a rank's files) and what each file holds, for ``write_metadata``."""
    named = [(f"__{rank}_{i}.distcp", part) for i, part in enumerate(split_files(items, files))]
    return [FileJob(d / name, sum(i.nbytes for i in part), _writer(part)) for name, part in named], named


def complete(d: Path, args: Any, stored: list[list]) -> None:
    """What completes a torch_dist folder once its .distcp files are written: common.pt,
    metadata.json, .metadata."""
    from .torch_legacy import CHECKPOINT_VERSION

    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}
    (d / "common.pt").write_bytes(torch_zip.torch_bytes(common, "common"))
    (d / "metadata.json").write_text(json.dumps(METADATA_JSON))
    write_metadata(d, stored)


def plan(d: Path, items: list[Item], args: Any, files: int) -> tuple[list[FileJob], Any]:
    """The .distcp file jobs (``files`` of them, for that many workers) and the step that
    completes the folder once they are written (``complete``)."""
    jobs, named = file_jobs(d, items, files)

    def finish() -> None:
        complete(d, args, records(named))

    return jobs, finish


def model_items(mm, targets: list[Target], keep=None) -> list[Item]:
    """The stored items of a model (``mm``: converters.mapping.ModelMap): its tensor pieces
    (``targets``) and its linear layers' ``_extra_state`` objects; with ``keep``, those whose
    global name (a module's: its ``.weight``) it accepts."""
    from .torch_dist import norm_keys
    from .torch_legacy import linear_modules

    keep = keep or (lambda name: True)
    axis = {"layer": mm.shape.num_layers, "expert": mm.shape.moe.num_experts if mm.shape.moe else 0}
    stacked, norms = not mm.shape.is_moe, norm_keys(mm.shape)
    items = [tensor_item(t, mm.global_shapes, axis, stacked, norms, mm.part_keys) for t in targets
             if keep(t.name.name)]
    modules = linear_modules([n for n in mm.global_shapes if n.startswith(("decoder.", "mtp."))])
    return items + [object_item(m, stacked, axis, norms) for m in modules if keep(f"{m}.weight")]


def import_dcp() -> None:
    import torch.distributed.checkpoint  # noqa: F401


def _writer(items: list[Item]):
    def write(path: Path, source: Source, meter: Meter, writer: FileWriter) -> None:
        write_distcp(path, items, source, meter, writer)

    return write
