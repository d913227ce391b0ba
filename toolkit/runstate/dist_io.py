"""Whole global tensors of a torch_dist folder for the training-state conversions
(toolkit.runstate), and megatron's own dist_checkpointing.save in one process.

The converters stream weights file to file without decoding them
(converters.formats.torch_dist); training state is converted tensor by tensor instead,
because the universal checkpoint stores each parameter's state as one torch.save file: this
reader decodes one stored chunk at a time (an LRU of CACHE_BYTES) and assembles the rows a
caller asks for, under a key prefix (``optimizer.state.exp_avg.``) as if they were the
model's own keys.
"""
from __future__ import annotations

import io
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from converters.errors import CorruptFileError, MissingTensorError
from converters.formats.torch_dist import NORM_KEYS, dist_key, is_stacked, stored_key
from converters.regions import as_2d

CACHE_BYTES = 1 << 30


class DistReader:
    """Global Megatron tensors by name, read chunk by chunk from a torch_dist folder.
    ``key_prefix``: read the tensors stored under that prefix (a distributed optimizer's
    ``optimizer.state.exp_avg.``) as if they were the model's."""

    def __init__(self, d: Path, norms: dict[str, str] = NORM_KEYS, te_norms: dict[str, str] | None = None,
                 key_prefix: str = ""):
        from torch.distributed.checkpoint import FileSystemReader

        self.dir, self.norms, self.te_norms, self.prefix = d, norms, te_norms or {}, key_prefix
        try:
            md = FileSystemReader(str(d)).read_metadata()
        except Exception as e:  # noqa: BLE001  (any unreadable metadata is a corrupt checkpoint)
            raise CorruptFileError(f"cannot read the DCP metadata of '{d}': {e}") from None
        self.tensors = {k[len(key_prefix):]: v for k, v in md.state_dict_metadata.items()
                        if hasattr(v, "chunks") and k.startswith(key_prefix)}
        self.storage = md.storage_data
        self.stacked = is_stacked(self.tensors)
        self._cache: OrderedDict = OrderedDict()

    def key(self, name: str) -> tuple[str, tuple[tuple[str, int], ...]]:
        return stored_key(name, self.tensors, self.stacked, self.norms, self.te_norms)

    def _locate(self, name: str):
        key, axes = self.key(name)
        prefix = tuple(i for _, i in axes)
        if key not in self.tensors:
            raise MissingTensorError(f"missing tensor '{name}' (torch_dist key '{key}')")
        return key, prefix, self.tensors[key]

    def meta(self, name):
        key, prefix, md = self._locate(name)
        return tuple(md.size)[len(prefix):], md.properties.dtype

    def _chunk(self, key: str, offsets: tuple[int, ...]) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        ck = (key, offsets)
        if ck not in self._cache:
            info = self.storage[MetadataIndex(self.prefix + key, torch.Size(offsets))]
            with open(self.dir / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            self._cache[ck] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            while sum(t.nbytes for t in self._cache.values()) > CACHE_BYTES and len(self._cache) > 1:
                self._cache.popitem(last=False)
        self._cache.move_to_end(ck)
        return self._cache[ck]

    def rows(self, name, start: int, stop: int) -> torch.Tensor:
        key, prefix, md = self._locate(name)
        shape = tuple(md.size)[len(prefix):]
        cols = as_2d(shape)[1]
        out = torch.empty((stop - start, cols), dtype=md.properties.dtype)
        filled = 0
        for c in md.chunks:
            off, size = tuple(c.offsets), tuple(c.sizes)
            if any(not (o <= p < o + s) for p, o, s in zip(prefix, off, size)):
                continue
            r0, r1 = max(start, off[len(prefix)]), min(stop, off[len(prefix)] + size[len(prefix)])
            if r0 >= r1:
                continue
            t = self._chunk(key, off)[tuple(p - o for p, o in zip(prefix, off))]
            t = t.reshape(size[len(prefix)], -1)
            c0 = off[len(prefix) + 1] if len(shape) > 1 else 0
            out[r0 - start:r1 - start, c0:c0 + t.shape[1]] = t[r0 - off[len(prefix)]:r1 - off[len(prefix)]]
            filled += (r1 - r0) * t.shape[1]
        if filled != out.numel():
            raise CorruptFileError(f"torch_dist checkpoint '{self.dir}' does not hold all of '{name}' (key '{key}')")
        return out


def sharded_tensor(name: str, data: torch.Tensor, row: int, col: int, global_shape: tuple[int, ...],
                   stacked: bool, axis_sizes: dict[str, int], norms: dict[str, str] = NORM_KEYS):
    """The ShardedTensor megatron's GPTModel.sharded_state_dict() makes for this chunk of a
    global tensor (rows [row, row+n) and columns [col, col+m) of its 2-D view)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    key, axes = dist_key(name, stacked, norms)
    offsets = [(j, i, axis_sizes[kind]) for j, (kind, i) in enumerate(axes)]
    lead = len(axes)
    if data.shape[0] != global_shape[0]:
        offsets.append((lead, row // data.shape[0], global_shape[0] // data.shape[0]))
    if data.dim() > 1 and data.shape[1] != global_shape[1]:
        offsets.append((lead + 1, col // data.shape[1], global_shape[1] // data.shape[1]))
    return ShardedTensor.from_rank_offsets(key, data, *offsets, replica_id=0, prepend_axis_num=lead)


def save(state: dict[str, Any], d: Path) -> None:
    """megatron's own dist_checkpointing.save, in a one-process gloo group if none is up."""
    import tempfile

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from toolkit.runtime import cpu_compat

    from converters.errors import ConversionSetupError

    cpu_compat.apply()  # the writer calls torch.cuda.synchronize(); a no-op on CPU-only machines
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConversionSetupError("writing torch_dist runs in one process; call it outside a multi-rank job")
        dist_checkpointing.save(state, str(d))
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
        try:
            dist_checkpointing.save(state, str(d))
        finally:
            dist.destroy_process_group()
