"""Reference torch_dist folders for the tests, written by megatron's own code: the
ShardedTensor megatron makes for a chunk of a global tensor, and megatron's
dist_checkpointing.save in one process."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from converters.formats.torch_dist import NORM_KEYS, dist_key


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

    from converters.errors import ConversionSetupError
    from toolkit.mcore import cpu_compat

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
