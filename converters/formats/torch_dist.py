"""Megatron's ``torch_dist`` checkpoint (megatron.core.dist_checkpointing on PyTorch DCP):
the keys, and reading by byte range.

Tensors are stored global: one key per tensor kind, layer and expert numbers as leading
axes ("stacked" keys ``decoder.layers.X`` with a layer axis for dense models, per-layer
keys ``decoder.layers.{l}.X`` when the layers differ, as in MoE models built with a
moe_layer_freq list), norms under their TransformerEngine names, chunks as the ranks that
wrote them held them. DCP's ``.metadata`` says where each chunk is: an ordinary torch.save
file at (file, offset, length) of a ``.distcp``. Reading needs no process group and loads
no tensor: each chunk is a source of its own (``DistChunk``), whose bytes are found inside
its torch.save file, and a global tensor is a list of copies from the chunks that hold it.
"""
from __future__ import annotations

import json
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any, NamedTuple

from toolkit.models.families.qwen3_next import GDN_NORM_KEY
from toolkit.regions import Copy, as_2d

from ..dtypes import DType, dtype_of
from ..errors import CheckpointError, CorruptFileError, MissingTensorError
from ..files import FileTensors, TensorInfo
from .dcp import read_plain_metadata, record_start

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
METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}


def is_torch_dist(d: Path) -> bool:
    return (d / "metadata.json").is_file()


def norm_keys(shape) -> dict[str, str]:
    """The norm renames megatron's local spec makes in its sharded state dict for this model; a
    gated delta net layer's input norm under GDN_NORM_KEY (toolkit.mcore.gated_delta_net)."""
    if shape.mla is not None:
        return {}
    la = shape.linear_attention
    own = {f"decoder.layers.{i}.input_layernorm.weight": f"decoder.layers.{i}.{GDN_NORM_KEY}"
           for i, linear in enumerate(la.layers) if linear} if la is not None else {}
    return {**NORM_KEYS, **own}


def part_key(key: str, parts, row: int) -> tuple[str, int, int]:
    """(stored key, first row, rows) of the part of a PARTS-split tensor holding global ``row``
    (``parts``: ModelMap.part_keys of the tensor)."""
    for part, start, rows in parts:
        if start <= row < start + rows:
            return f"{key}.{part}", start, rows
    raise ValueError(f"row {row} is in no part of {key}")


def _layer_key(rest: str, norms: dict[str, str]) -> tuple[str, tuple[tuple[str, int], ...]]:
    """A decoder layer's tensor name (after the layer prefix) as stored, with its expert axis."""
    rest = norms.get(rest, rest)
    e = _EXPERT.match(rest)
    if e is None:
        return rest, ()
    return f"mlp.experts.experts.{e.group(2)}." + rest[e.end():], (("expert", int(e.group(1))),)


def dist_key(name: str, stacked: bool, norms: dict[str, str] = NORM_KEYS) -> tuple[str, tuple[tuple[str, int], ...]]:
    """(key, leading axes as ("layer"|"expert", index)) under which a global tensor (or a
    module's ``_extra_state``) is stored; ``norms``: the spec's norm renames (norm_keys: by the
    name inside a layer, or by the whole name for one layer)."""
    name = norms.get(name, name)
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


def is_stacked(keys) -> bool:
    """Whether a checkpoint's layer keys are stacked (``decoder.layers.<param>`` with a layer axis)."""
    return any(k.startswith("decoder.layers.") and not k[15:16].isdigit() for k in keys)


def stored_key(name: str, keys, stacked: bool, norms: dict[str, str],
               te_norms: dict[str, str]) -> tuple[str, tuple[tuple[str, int], ...]]:
    """Where ``name`` is stored among ``keys``: under the local spec's key, else the TE spec's."""
    key, axes = dist_key(name, stacked, norms)
    if key not in keys and te_norms:
        te_key, te_axes = dist_key(name, stacked, {**norms, **te_norms})
        if te_key in keys:
            return te_key, te_axes
    return key, axes


def load_common(d: Path, plain: bool = False) -> dict[str, Any]:
    """common.pt (args, iteration...), weights_only; {} when absent. ``plain``: read without
    torch (torch_pickle.load_plain: a dtype in the args is a converters DType)."""
    from .torch_pickle import load_plain, load_torch

    meta = json.loads((d / "metadata.json").read_text())
    if meta.get("sharded_backend") != "torch_dist":
        raise CheckpointError(f"'{d}' is a '{meta.get('sharded_backend')}' checkpoint; only torch_dist is read")
    if not (d / "common.pt").is_file():
        return {}
    return (load_plain if plain else load_torch)(d / "common.pt", str(d / "common.pt"))


class DistChunk(NamedTuple):
    """One stored chunk of a torch_dist key, named by its global offsets."""

    key: str
    offsets: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.key} chunk at {list(self.offsets)}"


class _Pending(NamedTuple):
    path: Path
    info: Any  # DCP's storage info of the record (file, offset, length)
    dtype: DType
    sizes: tuple[int, ...]  # the chunk's shape as stored
    shape: tuple[int, ...]  # its 2-D view for the conversion


class DistReader(FileTensors):
    """The chunks of a torch_dist folder as sources; where a chunk's bytes start inside its
    torch.save file is read (pickle and zip directory only) when it is first copied."""

    def __init__(self, d: Path, norms: dict[str, str] = NORM_KEYS, te_norms: dict[str, str] | None = None,
                 metadata=None):
        """``metadata``: the folder's DCP metadata when the caller has read it already."""
        super().__init__({}, what=str(d))
        self.dir, self.norms, self.te_norms = d, norms, te_norms or {}
        md = metadata if metadata is not None else read_plain_metadata(d)
        self.keys = {k: v for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
        self.storage = {(i.fqn, tuple(i.offset)): s for i, s in md.storage_data.items() if i.offset is not None}
        self.stacked = is_stacked(self.keys)
        self.parts: dict[str, tuple[tuple[str, int, int], ...]] = {}  # ModelMap.part_keys (names_for)
        self._pending: dict[DistChunk, _Pending] = {}

    def names_for(self, shape, parts: dict | None = None) -> None:
        """Store names as the spec of this model does (known once the model is, which for a
        checkpoint without args takes the MTP modules in these keys); ``parts``: the model's
        tensors stored one key per part (ModelMap.part_keys)."""
        self.norms, self.te_norms = norm_keys(shape), (TE_MLA_KEYS if shape.mla is not None else {})
        self.parts = parts or {}

    def key(self, name: str) -> tuple[str, tuple[tuple[str, int], ...]]:
        return stored_key(name, self.keys, self.stacked, self.norms, self.te_norms)

    def stored_keys(self, name: str) -> list[tuple[str, int]]:
        """(stored key, first row in the global tensor) of each key holding ``name``."""
        key, _ = self.key(name)
        if name not in self.parts:
            return [(key, 0)]
        return [(f"{key}.{part}", start) for part, start, _ in self.parts[name]]

    def global_meta(self, name: str) -> tuple[tuple[int, ...], DType]:
        """(shape, dtype) of the global (per layer, per expert) tensor ``name``; a tensor stored
        by parts is its parts' rows one after the other."""
        _, axes = self.key(name)
        shapes = []
        for key, _ in self.stored_keys(name):
            if key not in self.keys:
                raise MissingTensorError(f"missing tensor '{name}' (torch_dist key '{key}')")
            shapes.append(tuple(self.keys[key].size)[len(axes):])
        if any(s[1:] != shapes[0][1:] for s in shapes):
            raise CorruptFileError(f"the parts of '{name}' in '{self.dir}' differ in shape: {shapes}")
        md = self.keys[self.stored_keys(name)[0][0]]
        return (sum(s[0] for s in shapes), *shapes[0][1:]), dtype_of(md.properties.dtype)

    def supply(self, name: str) -> list[Copy]:
        """Copies from the chunks that hold global tensor ``name`` (its 2-D view; each chunk
        whole in the dims after the first unless the tensor is 2-D)."""
        _, axes = self.key(name)
        prefix = tuple(i for _, i in axes)
        shape, dtype = self.global_meta(name)
        cols = as_2d(shape)[1]
        copies = []
        for key, start in self.stored_keys(name):
            for c in self.keys[key].chunks:
                off, size = tuple(c.offsets), tuple(c.sizes)
                if any(not (o <= p < o + s) for p, o, s in zip(prefix, off, size)):
                    continue
                chunk = DistChunk(key, off)
                width = size[-1] if len(shape) == 2 else cols
                self._register(chunk, size, width, dtype)
                inner = sum((p - o) * _stride(size, j) for j, (p, o) in enumerate(zip(prefix, off)))
                rows = size[len(prefix)]
                dst_col = off[-1] if len(shape) == 2 else 0
                copies.append(Copy(chunk, name, inner // width, 0, start + off[len(prefix)], dst_col, rows, width))
        return copies

    def _register(self, chunk: DistChunk, sizes: tuple[int, ...], cols: int, dtype: DType) -> None:
        if chunk in self._pending:
            return
        info = self.storage.get((chunk.key, chunk.offsets))
        if info is None:
            raise CorruptFileError(f"torch_dist checkpoint '{self.dir}' lists {chunk} but stores no bytes for it")
        numel = 1
        for s in sizes:
            numel *= s
        self._pending[chunk] = _Pending(self.dir / info.relative_path, info, dtype, sizes, (numel // cols, cols))

    def meta(self, name: Hashable):
        if isinstance(name, DistChunk) and name in self._pending:
            p = self._pending[name]
            return p.shape, p.dtype
        raise MissingTensorError(f"missing tensor '{name}'")

    def info(self, name) -> TensorInfo:
        if name not in self.tensors:
            self.tensors[name] = self._locate(name)
        return self.tensors[name]

    def _locate(self, chunk: DistChunk) -> TensorInfo:
        """Where the chunk's bytes start (converters.formats.dcp.record_start)."""
        p = self._pending[chunk]
        start = record_start(self.fd(p.path), p.info, f"{p.path} ({chunk})", p.sizes, p.dtype)
        return TensorInfo(p.path, p.dtype, p.shape, start)


def _stride(sizes: tuple[int, ...], axis: int) -> int:
    n = 1
    for s in sizes[axis + 1:]:
        n *= s
    return n
