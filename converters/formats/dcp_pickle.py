"""DCP's ``.metadata`` written without importing torch (issue 44).

``FileSystemWriter.finish`` pickles (protocol 4) a ``torch.distributed.checkpoint.metadata.
Metadata``: per key a TensorStorageMetadata (TensorProperties pickled as the tuple its
``__getstate__`` gives, with the layout as ``torch.serialization._get_layout('torch.strided')``
and the memory format as ``_MEM_FORMAT_ENCODING(0)``; ``torch.Size`` as a REDUCE of a tuple;
a dtype as the global ``torch.<name>``) or a BytesStorageMetadata, per record a MetadataIndex
-> _StorageInfo (``__getstate__`` drops its None fields), a StorageMeta naming the folder and
the save's uuid, and DCP's version. Every object is an instance pickled as ``NEWOBJ`` of its
class and ``BUILD`` with its ``__dict__`` in field order. ``metadata_bytes`` writes those
opcodes from plain records through the pure-Python pickler (whose ``save`` dispatches on type,
as converters.formats.torch_pickle's does), naming torch's classes without importing them;
the tests compare the result byte for byte with ``FileSystemWriter.finish``'s own.
"""
from __future__ import annotations

import io
import os
import pickle
import uuid
from pathlib import Path, PosixPath

DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem's CURRENT_DCP_VERSION (a test checks it)
_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
# torch's pickle names torch.Size's module with a string object of its own (the class's
# __module__), not the one it memoized for the dtypes: written again, not referred back to
_SIZE_MODULE = "".join(("tor", "ch"))


class _Global:
    """A class or function named in the pickle (``STACK_GLOBAL``), one object per name."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


class _New:
    """An instance: ``NEWOBJ`` of ``cls`` with no arguments, then ``BUILD`` with ``state``
    (none for an empty ``__dict__``)."""

    __slots__ = ("cls", "state")

    def __init__(self, cls: _Global, state):
        self.cls, self.state = cls, state


class _Call:
    """``func(*args)`` (``REDUCE``)."""

    __slots__ = ("func", "args")

    def __init__(self, func: _Global, args: tuple):
        self.func, self.args = func, args


class _Pickler(pickle._Pickler):
    dispatch = dict(pickle._Pickler.dispatch)

    def _save_global(self, obj: _Global) -> None:
        self.save(obj.module)
        self.save(obj.name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    def _save_new(self, obj: _New) -> None:
        self.save(obj.cls)
        self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
        self.memoize(obj)
        if obj.state != {}:  # object.__getstate__ gives None for an empty __dict__: no BUILD
            self.save(obj.state)
            self.write(pickle.BUILD)

    def _save_call(self, obj: _Call) -> None:
        self.save(obj.func)
        self.save(obj.args)
        self.write(pickle.REDUCE)
        self.memoize(obj)

    dispatch[_Global] = _save_global
    dispatch[_New] = _save_new
    dispatch[_Call] = _save_call


class _Names:
    """One _Global per name, so the memo refers back to it as torch's pickle does."""

    def __init__(self):
        self.seen: dict[tuple[str, str], _Global] = {}

    def __call__(self, module: str, name: str) -> _Global:
        return self.seen.setdefault((module, name), _Global(module, name))


def _fresh(dims) -> tuple[int, ...]:
    """A new tuple object (each torch.Size reduces to its own tuple; pickle's memo would refer
    back to a tuple object seen before)."""
    return tuple([int(d) for d in dims])


def metadata_bytes(records: list[list], folder: Path, save_id: str | None = None) -> bytes:
    """The ``.metadata`` of a folder whose records (torch_dist_write.records: [file, key,
    offsets or None, sizes, global shape, dtype name or None, bytes], in file order) were written
    back to back in their files, as ``FileSystemWriter(str(folder)).finish`` pickles it."""
    g = _Names()
    size = g(_SIZE_MODULE, "Size")
    # torch.strided and _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT are singletons: built once, referred back to
    strided = _Call(g("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = _Call(g(_MD, "_MEM_FORMAT_ENCODING"), (0,))
    state: dict = {}
    storage: dict = {}
    base: dict[str, int] = {}
    for name, key, offsets, sizes, global_shape, dtype, nbytes in records:
        if offsets is None:
            state[key] = _New(g(_MD, "BytesStorageMetadata"), {})
            index = _New(g(_MD, "MetadataIndex"), {"fqn": key, "index": None})
        else:
            if key not in state:
                props = _New(g(_MD, "TensorProperties"), (g("torch", dtype), strided, False, contiguous, False))
                state[key] = _New(g(_MD, "TensorStorageMetadata"), {
                    "properties": props, "size": _Call(size, (_fresh(global_shape),)), "chunks": []})
            chunk = {"offsets": _Call(size, (_fresh(offsets),)), "sizes": _Call(size, (_fresh(sizes),))}
            state[key].state["chunks"].append(_New(g(_MD, "ChunkStorageMetadata"), chunk))
            offset = _Call(size, (_fresh(offsets),))
            index = _New(g(_MD, "MetadataIndex"), {"fqn": key, "index": None, "offset": offset})
        at = base.get(name, 0)
        storage[index] = _New(g(_FS, "_StorageInfo"), {"relative_path": name, "offset": at, "length": nbytes})
        base[name] = at + nbytes
    path = PosixPath(str(folder))
    meta = _New(g(_MD, "StorageMeta"), {"checkpoint_id": _Call(g("pathlib", "PosixPath"), tuple(path.parts)),
                                        "save_id": save_id or str(uuid.uuid4()), "load_id": None, "modules": []})
    md = _New(g(_MD, "Metadata"), {"state_dict_metadata": state, "planner_data": None, "storage_data": storage,
                                   "storage_meta": meta, "version": DCP_VERSION})
    buf = io.BytesIO()
    _Pickler(buf, protocol=4).dump(md)
    return buf.getvalue()


def write_metadata(folder: Path, records: list[list]) -> None:
    """``folder/.metadata`` as FileSystemWriter(sync_files=False).finish leaves it: written to
    ``.metadata.tmp``, then renamed."""
    tmp = folder / ".metadata.tmp"
    tmp.write_bytes(metadata_bytes(records, folder))
    os.replace(tmp, folder / ".metadata")
