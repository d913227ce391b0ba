"""The ``data.pkl`` of a torch.save file, written without torch; tensors read back as offsets.

Writing: torch.save pickles (protocol 2) the object with each tensor reduced to
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())``,
each storage a persistent id ``('storage', torch.<T>Storage, key, 'cpu', numel)`` whose
bytes live in the zip record ``data/<key>``. ``dumps`` produces the same opcodes from
``TensorSpec`` placeholders (and ``DType`` values as ``torch.<dtype>`` globals), so the
converters lay out a legacy checkpoint without importing torch; the tests compare the
result byte for byte with torch.save's own.

Reading: torch.load with ``map_location="meta"`` reads only the pickle and the zip's
directory, and gives every storage the file offset of its record (``_checkpoint_offset``):
that, plus the tensor's storage offset, is where its bytes lie. ``load_plain`` finds the
same without importing torch (converters.formats.torch_unpickle), and falls back to
torch.load only for a pickle holding objects that need torch to be built.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..dtypes import DType, dtype_of
from ..errors import CorruptFileError

PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL


@dataclass(frozen=True)
class TensorSpec:
    """A contiguous tensor to be stored in its own record (``data/<key>``)."""

    shape: tuple[int, ...]
    dtype: DType

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(self.shape)


@dataclass(frozen=True)
class _Global:
    """A module-level name pickled by reference (GLOBAL opcode), never imported here."""

    module: str
    name: str

    def __call__(self, *args):  # pickle's save_reduce wants a callable; this one is only named
        raise TypeError(f"{self.module}.{self.name} is a name for the pickle, not a function")


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: DType
    numel: int


_REBUILD_V2 = _Global("torch._utils", "_rebuild_tensor_v2")
_REBUILD_V3 = _Global("torch._utils", "_rebuild_tensor_v3")  # dtypes without a legacy storage class
_UNTYPED = _Global("torch.storage", "UntypedStorage")


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


class _Pickler(pickle._Pickler):
    """The pure-Python pickler (its ``save`` consults ``dispatch`` per type), taught to write
    ``_Global`` and ``DType`` as globals and TensorSpecs as torch.save writes tensors."""

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file):
        super().__init__(file, protocol=PROTOCOL)
        self.storages: list[TensorSpec] = []
        self._globals: dict[_Global, _Global] = {}  # one object per name, so the memo reuses it

    def _global(self, module: str, name: str) -> _Global:
        g = _Global(module, name)
        return self._globals.setdefault(g, g)

    def _save_global_ref(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    def _save_dtype(self, obj: DType) -> None:
        self._save_global_ref(self._global("torch", obj.name))

    dispatch[_Global] = _save_global_ref
    dispatch[DType] = _save_dtype

    def persistent_id(self, obj: Any):
        if not isinstance(obj, _Storage):
            return None
        kind = _UNTYPED if obj.dtype.storage is None else self._global("torch", obj.dtype.storage)
        numel = obj.numel * (obj.dtype.itemsize if obj.dtype.storage is None else 1)
        return ("storage", self._globals.setdefault(kind, kind), obj.key, "cpu", numel)

    def reducer_override(self, obj: Any):
        if not isinstance(obj, TensorSpec):
            return NotImplemented
        numel = obj.nbytes // obj.dtype.itemsize
        storage = _Storage(str(len(self.storages)), obj.dtype, numel)
        self.storages.append(obj)
        hooks = collections.OrderedDict()
        args = (storage, 0, tuple(obj.shape), _contiguous_strides(tuple(obj.shape)), False, hooks)
        if obj.dtype.storage is None:
            return self._global(_REBUILD_V3.module, _REBUILD_V3.name), args + (obj.dtype,)
        return self._global(_REBUILD_V2.module, _REBUILD_V2.name), args


def dumps(obj: Any) -> tuple[bytes, list[TensorSpec]]:
    """(data.pkl bytes, the TensorSpecs in record order: record ``data/i`` holds the i-th).
    Every TensorSpec object gets its own record, in the order pickling meets them."""
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(obj)
    return buf.getvalue(), p.storages


# ---------------------------------------------------------------------------- reading
class ByteRange(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file as a seekable read-only file (a DCP
    item, which is a whole torch.save file inside a ``.distcp``)."""

    def __init__(self, fd: int, offset: int, length: int):
        super().__init__()
        self.fd, self.start, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos) if n else b""
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


@dataclass(frozen=True)
class StoredTensor:
    """Where a contiguous tensor's bytes lie: ``offset`` from the start of the torch.save file."""

    shape: tuple[int, ...]
    dtype: DType
    offset: int


def _base_globals() -> list:
    import argparse
    import types

    return [argparse.Namespace, types.SimpleNamespace]


def _megatron_globals() -> list:
    """Megatron-LM's own allow-list (its enums in ``args``): importing megatron.core takes
    seconds, so it is asked for only when a pickle names one of its classes."""
    from megatron.core.safe_globals import SAFE_GLOBALS

    return list(SAFE_GLOBALS)


def load_torch(f, what: str, meta: bool = True) -> Any:
    """torch.load of a torch.save file (path or file object), weights_only (no code runs from
    the pickle), allowing argparse.Namespace and, when the pickle names them, Megatron-LM's
    safe globals. ``meta``: every tensor on the meta device (only the pickle and the zip
    directory are read); else tensors memory-mapped. Raises CorruptFileError naming ``what``."""
    try:
        return with_named_globals(lambda allowed: _load(f, what, allowed, meta), _base_globals(),
                                  {"megatron": _megatron_globals})
    except pickle.UnpicklingError as e:
        raise CorruptFileError(f"cannot load '{what}' with weights_only=True: {str(e).splitlines()[0]}") from None


def load_plain(f, what: str) -> Any:
    """The object of a torch.save file (path or seekable binary file) with every tensor a
    PlainTensor (shape, strides, dtype, file offset: what ``stored`` needs), read without
    torch; a pickle naming objects only torch.load builds (numpy arrays, Megatron-LM's
    enums) is read by ``load_torch`` onto the meta device instead. Raises CorruptFileError
    naming ``what``, also for a global neither would allow."""
    from .torch_unpickle import NeedsTorch, load_zip

    try:
        if hasattr(f, "seek"):
            return load_zip(f, what)
        with open(f, "rb") as fh:
            return load_zip(fh, what)
    except NeedsTorch:
        return load_torch(f, what)
    except OSError as e:
        raise CorruptFileError(f"'{what}' is not a readable torch checkpoint: {e}") from None


def is_tensor(x: Any) -> bool:
    """A tensor from ``load_plain`` (a PlainTensor, or torch's own after a fallback)."""
    from .torch_unpickle import PlainTensor

    if isinstance(x, PlainTensor):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def with_named_globals(load: Callable[[list], Any], allowed: list, named: dict[str, Callable[[], list]]) -> Any:
    """``load(allowed)``, a weights-only torch.load; when its pickle names a library of
    ``named`` (whose allow-list takes seconds to import), once more with that library's
    allow-list added. The second refusal (or a first one naming none) is raised."""
    try:
        return load(allowed)
    except pickle.UnpicklingError as e:
        extra = [make for lib, make in named.items() if lib in str(e)]
        if not extra:
            raise
    return load(allowed + [g for make in extra for g in make()])


def _load(f, what: str, safe_globals: list, meta: bool) -> Any:
    import zipfile

    import torch

    if hasattr(f, "seek"):
        f.seek(0)
    if not zipfile.is_zipfile(f):  # torch would try its pre-1.6 pickle format and fail in the pickle
        raise CorruptFileError(f"'{what}' is not a readable torch checkpoint: not a zip file")
    if hasattr(f, "seek"):
        f.seek(0)
    try:
        with torch.serialization.safe_globals(safe_globals):
            if meta:
                return torch.load(f, map_location="meta", weights_only=True)
            return torch.load(f, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as e:
        raise CorruptFileError(f"'{what}' is not a readable torch checkpoint: {str(e).splitlines()[0]}") from None


def stored(t, what: str) -> StoredTensor:
    """The StoredTensor of a meta tensor from ``load_torch`` or a PlainTensor from ``load_plain``."""
    from .torch_unpickle import PlainTensor

    if isinstance(t, PlainTensor):
        if not t.is_contiguous():
            raise CorruptFileError(f"'{what}' is stored non-contiguous (strides {t.strides}); only "
                                   "contiguous tensors are read")
        return StoredTensor(t.shape, t.dtype, t.offset)
    if not t.is_contiguous():
        raise CorruptFileError(f"'{what}' is stored non-contiguous (strides {tuple(t.stride())}); only "
                               "contiguous tensors are read")
    offset = t.untyped_storage()._checkpoint_offset + t.storage_offset() * t.element_size()
    return StoredTensor(tuple(t.shape), dtype_of(t.dtype), offset)
