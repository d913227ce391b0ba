"""Megatron's ``torch_dist`` checkpoint (megatron.core.dist_checkpointing on PyTorch DCP).

Tensors are stored global: one key per tensor kind, layer and expert numbers as leading
axes ("stacked" keys ``decoder.layers.X`` with a layer axis for dense models, per-layer
keys ``decoder.layers.{l}.X`` when the layers differ, as in MoE models built with a
moe_layer_freq list), norms under their TransformerEngine names, chunks as the ranks that
wrote them held them. Reading needs no process group: each chunk is an ordinary
torch.save record at a known offset of a ``.distcp`` file (DCP's own storage metadata).
"""
from __future__ import annotations

import io
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, CorruptFileError, MissingTensorError
from ..regions import as_2d

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_MTP_LAYER = re.compile(r"^mtp\.layers\.\d+\.transformer_layer\.")  # MTP modules: per-module keys, no layer axis
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.")
# local-spec norm names -> the names megatron's sharded state dict stores them under
NORM_KEYS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
# megatron-core's local MLA spec maps no norm name; its TE spec fuses the q/kv latent norms
# into the up-projections and a dense layer's pre-MLP norm into linear_fc1 (read as well)
TE_MLA_KEYS = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
               "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def norm_keys(shape) -> dict[str, str]:
    """The norm renames megatron's local spec makes in its sharded state dict for this model."""
    return {} if shape.mla is not None else NORM_KEYS
CACHE_BYTES = 1 << 30


def is_torch_dist(d: Path) -> bool:
    return (d / "metadata.json").is_file()


def _layer_key(rest: str, norms: dict[str, str]) -> tuple[str, tuple[tuple[str, int], ...]]:
    """A decoder layer's tensor name (after the layer prefix) as stored, with its expert axis."""
    rest = norms.get(rest, rest)
    e = _EXPERT.match(rest)
    if e is None:
        return rest, ()
    return f"mlp.experts.experts.{e.group(2)}." + rest[e.end():], (("expert", int(e.group(1))),)


def dist_key(name: str, stacked: bool, norms: dict[str, str] = NORM_KEYS) -> tuple[str, tuple[tuple[str, int], ...]]:
    """(key, leading axes as ("layer"|"expert", index)) under which a global tensor (or a
    module's ``_extra_state``) is stored; ``norms``: the spec's norm renames (norm_keys)."""
    m = _LAYER.match(name)
    if m is None:
        t = _MTP_LAYER.match(name)
        if t is None:
            return name, ()
        rest, prefix = _layer_key(name[t.end():], norms)
        return name[:t.end()] + rest, prefix
    layer = int(m.group(1))
    rest, prefix = _layer_key(name[m.end():], norms)
    if stacked:
        return "decoder.layers." + rest, (("layer", layer), *prefix)
    return f"decoder.layers.{layer}." + rest, prefix


def load_common(d: Path) -> dict[str, Any]:
    from .torch_legacy import _safe_globals

    meta = json.loads((d / "metadata.json").read_text())
    if meta.get("sharded_backend") != "torch_dist":
        raise CheckpointError(f"'{d}' is a '{meta.get('sharded_backend')}' checkpoint; only torch_dist is read")
    if not (d / "common.pt").is_file():
        return {}
    with torch.serialization.safe_globals(_safe_globals()):
        return torch.load(d / "common.pt", map_location="cpu", weights_only=True)


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
        self.stacked = any(k.startswith("decoder.layers.") and not k[15:16].isdigit() for k in self.tensors)
        self._cache: OrderedDict = OrderedDict()

    def key(self, name: str) -> tuple[str, tuple[tuple[str, int], ...]]:
        """Where ``name`` is stored: under the local spec's key, else the TE spec's."""
        key, axes = dist_key(name, self.stacked, self.norms)
        if key not in self.tensors and self.te_norms:
            te_key, te_axes = dist_key(name, self.stacked, {**self.norms, **self.te_norms})
            if te_key in self.tensors:
                return te_key, te_axes
        return key, axes

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


# ---------------------------------------------------------------------------- writing
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


def extra_state(module: str, stacked: bool, axis_sizes: dict[str, int], norms: dict[str, str] = NORM_KEYS):
    """The ShardedObject megatron stores for a linear layer's ``_extra_state`` (None without TE)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    key, axes = dist_key(f"{module}._extra_state", stacked, norms)
    shape = tuple(axis_sizes[k] for k, _ in axes) or (1,)
    offset = tuple(i for _, i in axes) or (0,)
    return ShardedObject(key, None, shape, offset, replica_id=0)


def save(state: dict[str, Any], d: Path) -> None:
    """megatron's own dist_checkpointing.save, in a one-process gloo group if none is up."""
    import tempfile

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from toolkit.runtime import cpu_compat

    from ..errors import ConversionSetupError

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


@dataclass(frozen=True)
class Piece:
    """A chunk of a global tensor as one rank holds it: rows/cols of its 2-D view."""

    name: str
    row: int
    col: int
    shape: tuple[int, ...]


def _stage(path: Path, targets: list, source, meter) -> dict:
    """Write every piece to one scratch file (64-byte aligned); piece -> offset."""
    import os

    from ..sink import FileWriter, write_target

    offsets, pos = {}, 0
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with FileWriter() as writer:
            for t in targets:
                pos += -pos % 64
                offsets[t.name] = pos
                write_target(writer, fd, pos, t, source, meter)
                pos += t.nbytes
        os.ftruncate(fd, max(pos, 1))
    finally:
        os.close(fd)
    return offsets


def write_checkpoint(out: Path, targets: list, global_shapes: dict[str, tuple[int, ...]], axis_sizes: dict[str, int],
                     args: Any, source, meter, stacked: bool, norms: dict[str, str] = NORM_KEYS) -> None:
    """``out/release`` written by dist_checkpointing.save from pieces staged on disk and
    memory-mapped (each its own storage, so megatron's writer never copies them)."""
    import numpy as np

    from .torch_legacy import CHECKPOINT_VERSION, ITERATION_FILE, linear_modules

    (out / ITERATION_FILE).write_text("release\n")
    d = out / "release"
    d.mkdir()
    staging = out / ".staging"
    offsets = _stage(staging, targets, source, meter)
    mm = np.memmap(staging, dtype=np.uint8, mode="r+")
    model: dict[str, Any] = {}
    for t in targets:
        p, off = t.name, offsets[t.name]
        data = torch.from_numpy(mm[off:off + t.nbytes]).view(t.dtype).view(t.shape)
        model[f"{p.name}@{p.row},{p.col}"] = sharded_tensor(p.name, data, p.row, p.col, global_shapes[p.name],
                                                             stacked, axis_sizes, norms)
    for module in linear_modules([n for n in global_shapes if n.startswith(("decoder.", "mtp."))]):
        model[f"{module}._extra_state"] = extra_state(module, stacked, axis_sizes, norms)
    save({"model": model, "args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}, d)
    del model, data, mm
    staging.unlink()
