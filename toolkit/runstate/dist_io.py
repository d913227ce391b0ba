"""Whole global tensors of a torch_dist folder for the training-state conversions
(toolkit.runstate), and megatron's own dist_checkpointing.save in one process.

The converters stream weights file to file without decoding them
(converters.formats.torch_dist); training state is converted tensor by tensor instead,
because the universal checkpoint stores each parameter's state as one torch.save file: this
reader assembles the rows a caller asks for, read by byte range from the stored chunks
(toolkit.dcp.Reader: no chunk is decoded or kept), under a key prefix
(``optimizer.state.exp_avg.``) as if they were the model's own keys.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from converters.errors import CorruptFileError, MissingTensorError
from converters.formats.torch_dist import NORM_KEYS, dist_key, is_stacked, stored_key
from converters.regions import as_2d


class DistReader:
    """Global Megatron tensors by name, read by byte range from a torch_dist folder.
    ``key_prefix``: read the tensors stored under that prefix (a distributed optimizer's
    ``optimizer.state.exp_avg.``) as if they were the model's."""

    def __init__(self, d: Path, norms: dict[str, str] = NORM_KEYS, te_norms: dict[str, str] | None = None,
                 key_prefix: str = ""):
        from toolkit import dcp

        self.dir, self.norms, self.te_norms, self.prefix = d, norms, te_norms or {}, key_prefix
        try:
            self._reader = dcp.Reader(d)
        except dcp.DCPError as e:
            raise CorruptFileError(str(e)) from None
        self.tensors = {k[len(key_prefix):]: v for k, v in self._reader.keys.items() if k.startswith(key_prefix)}
        self.stacked = is_stacked(self.tensors)

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> DistReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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

    def rows(self, name, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the global tensor ``name`` (its 2-D view), in its stored dtype."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        from toolkit import dcp

        key, prefix, md = self._locate(name)
        shape = tuple(md.size)[len(prefix):]
        out = torch.empty((stop - start, *shape[1:]), dtype=md.properties.dtype)
        sh = ShardedTensor(self.prefix + key, out, out.dtype, tuple(out.shape), tuple(md.size),
                           prefix + (start,) + (0,) * (len(shape) - 1), None, prepend_axis_num=len(prefix))
        try:
            self._reader.fill(sh)
        except dcp.DCPError as e:
            raise CorruptFileError(f"{e} ('{name}')") from None
        return out.reshape(stop - start, as_2d(shape)[1])


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
