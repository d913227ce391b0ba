"""Reading torch.save files and DCP ``.metadata`` pickles without importing torch.

A conversion reads pickles only to learn where the bytes of each tensor lie: torch.load onto
the meta device does that, but ``import torch`` costs about 2 CPU s and
``torch.distributed.checkpoint`` another second (issue 44). Here a ``pickle.Unpickler``
whose ``find_class`` knows an explicit allow-list (as torch.load's ``weights_only=True``
does) builds stand-ins instead of torch objects:

- a tensor, ``torch._utils._rebuild_tensor_v2/_v3(storage, offset, size, stride, ...)``, is a
  ``PlainTensor`` whose storage is the zip record ``<prefix>/data/<key>`` named by the
  persistent id ``('storage', <storage type>, key, location, numel)``, the record's data
  offset read from the zip's directory and local header (torch's ``_checkpoint_offset``);
- ``torch.<dtype>`` is the converters ``DType`` of that name (which pickles back as the same
  global), ``torch.Size`` a tuple, the storage classes a dtype; argparse.Namespace,
  SimpleNamespace, OrderedDict, io.BytesIO (TransformerEngine's ``_extra_state``) and the
  ``_codecs.encode(str, 'latin1')`` protocol 2 writes bytes with are themselves;
- DCP's dataclasses (Metadata, TensorStorageMetadata, ChunkStorageMetadata, MetadataIndex,
  _StorageInfo, BytesStorageMetadata, TensorProperties, StorageMeta, and the SavePlan,
  WriteItem, TensorWriteData and BytesIOWriteData megatron-core leaves in ``planner_data``)
  are plain classes with the same fields; a pickled field this module does not know is an
  error, not dropped.

Globals torch (or Megatron-LM's allow-list) would allow but that have no stand-in here
(numpy arrays of an RNG state, Megatron's enums, a dtype without a DType) raise
``NeedsTorch``: the caller then reads the file with torch.load, which builds them. Any other
global (``os.system``) raises CorruptFileError, torch or not. So does any file detail this
reader was not written for (another byte order, an unknown format version, a compressed
record, a record shorter than its storage): such a file is refused, never misread.
"""
from __future__ import annotations

import argparse
import collections
import enum
import io
import pathlib
import pickle
import struct
import types
import zipfile
from dataclasses import dataclass
from typing import Any

from ..dtypes import BY_NAME, DType
from ..errors import CorruptFileError

FORMAT_VERSIONS = {"1"}  # torch's ``.format_version`` records read here (torch 2.x writes 1)
ARCHIVE_VERSIONS = {"1", "2", "3"}  # its ``version`` record (the pickle's storage conventions)
# Megatron-LM's SAFE_GLOBALS (megatron.core.safe_globals), which torch.load is given for its
# files: allowed, but only torch.load builds them (a test checks this list against megatron's);
# torch.load also judges any global of torch, builtins or numpy (its own allow-list)
MEGATRON_GLOBALS = frozenset({
    "types.SimpleNamespace", "pathlib.PosixPath", "numpy._core.multiarray._reconstruct", "numpy.ndarray",
    "numpy.dtype", "numpy.dtypes.UInt32DType", "argparse.Namespace", "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope", "megatron.core.enums.ModelType",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig", "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode", "megatron.core.rerun_state_machine.RerunState", "_io.BytesIO",
    "signal.Signals"})


class NeedsTorch(pickle.UnpicklingError):
    """The pickle names a global that torch.load (weights_only, with Megatron-LM's allow-list)
    accepts but this reader has no stand-in for: read the file with torch."""


# ---------------------------------------------------------------------------- tensors
@dataclass(frozen=True)
class PlainStorage:
    """A storage record: ``offset`` is where its bytes start in the file, ``nbytes`` its size."""

    key: str
    dtype: DType | None  # None: an UntypedStorage (the tensor names its dtype)
    nbytes: int
    offset: int


@dataclass(frozen=True)
class PlainTensor:
    """What torch.load onto the meta device gives, without torch: shape, strides, dtype and
    the storage (with its file offset) of a pickled tensor."""

    storage: PlainStorage
    storage_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: DType

    def stride(self) -> tuple[int, ...]:
        return self.strides

    def is_contiguous(self) -> bool:
        """torch's rule: dims of size 1 may have any stride; an empty tensor is contiguous."""
        if 0 in self.shape:
            return True
        step = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != step:
                return False
            step *= size
        return True

    @property
    def offset(self) -> int:
        """Where element 0 lies in the file."""
        return self.storage.offset + self.storage_offset * self.dtype.itemsize


@dataclass(frozen=True)
class _StorageKind:
    """``torch.<T>Storage`` (a dtype's legacy storage) or UntypedStorage (dtype None)."""

    dtype: DType | None


_STORAGES = {("torch", d.storage): _StorageKind(d) for d in BY_NAME.values() if d.storage}
_STORAGES[("torch", "UntypedStorage")] = _STORAGES[("torch.storage", "UntypedStorage")] = _StorageKind(None)


def _extent(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements from the first to one past the last of a strided tensor (0 if empty)."""
    if 0 in shape:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def _rebuild(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    if not isinstance(storage, PlainStorage):
        raise CorruptFileError(f"a tensor's storage is {type(storage).__name__}, not a storage record")
    if backward_hooks:
        raise CorruptFileError("a tensor is pickled with backward hooks")
    dtype = storage.dtype if dtype is None else dtype
    if storage.dtype is not None and storage.dtype != dtype:
        raise CorruptFileError(f"a {dtype} tensor on a {storage.dtype} storage")
    size, stride = tuple(size), tuple(stride)
    if len(size) != len(stride) or not all(isinstance(x, int) and x >= 0 for x in size + stride + (storage_offset,)):
        raise CorruptFileError(f"a tensor of size {list(size)}, stride {list(stride)}, offset {storage_offset}")
    need = (storage_offset + _extent(size, stride)) * dtype.itemsize if 0 not in size else 0
    if need > storage.nbytes:
        raise CorruptFileError(f"a tensor needs {need} bytes of its storage '{storage.key}', which has "
                               f"{storage.nbytes}")
    return PlainTensor(storage, storage_offset, size, stride, dtype)


def _rebuild_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    return _rebuild(storage, storage_offset, size, stride, requires_grad, backward_hooks, None, metadata)


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    if not isinstance(dtype, DType):
        raise CorruptFileError(f"a tensor's dtype is {dtype!r}")
    return _rebuild(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata)


def _encode(text: str, encoding: str) -> bytes:
    """_codecs.encode as pickle protocol 2 writes bytes: ``encode(str, 'latin1')``."""
    if not isinstance(text, str) or encoding != "latin1":
        raise CorruptFileError(f"_codecs.encode({type(text).__name__}, {encoding!r}) is not how pickle writes bytes")
    return text.encode("latin1")


def _size(dims=()) -> tuple[int, ...]:
    """torch.Size(dims), as the tuple it is."""
    return tuple(int(d) for d in dims)


# ---------------------------------------------------------------------------- DCP metadata
class _Record:
    """A DCP dataclass: its pickle is NEWOBJ() then BUILD with a dict of fields (DCP does not
    pickle defaults it never set: they are class attributes). A field not listed is refused."""

    FIELDS: tuple[str, ...] = ()
    EXTRA: tuple[str, ...] = ()  # attributes a known writer adds beside the dataclass's fields

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
            state = state[0]
        if not isinstance(state, dict) or set(state) - set(self.FIELDS + self.EXTRA):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CorruptFileError(f"{type(self).__name__} is pickled with {got}; this reader knows "
                                   f"the fields {list(self.FIELDS + self.EXTRA)}")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in self.FIELDS)})"


class Metadata(_Record):
    FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
    EXTRA = ("all_local_plans",)  # megatron-core's save keeps every rank's SavePlan here
    state_dict_metadata: dict
    planner_data = None
    storage_data = None
    storage_meta = None
    version = None


class TensorStorageMetadata(_Record):
    FIELDS = ("properties", "size", "chunks")


class ChunkStorageMetadata(_Record):
    FIELDS = ("offsets", "sizes")


class BytesStorageMetadata(_Record):
    FIELDS = ()


class StorageMeta(_Record):
    FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")
    checkpoint_id = None
    save_id = ""
    load_id = ""
    modules: list = []


class StorageInfo(_Record):
    """torch.distributed.checkpoint.filesystem._StorageInfo"""

    FIELDS = ("relative_path", "offset", "length", "transform_descriptors")
    transform_descriptors = None


class MetadataIndex(_Record):
    """Hashed and compared by (fqn, offset), as DCP's frozen dataclass (``index`` is a hint)."""

    FIELDS = ("fqn", "offset", "index")
    offset = None
    index = None

    def _key(self):
        return self.fqn, None if self.offset is None else tuple(self.offset)

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other) -> bool:
        return isinstance(other, MetadataIndex) and self._key() == other._key()


class MemoryFormat(enum.Enum):
    """torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING"""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


class TensorProperties:
    """Pickled as the tuple (dtype, layout, requires_grad, memory format encoding, pin_memory)."""

    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    def __setstate__(self, state) -> None:
        if not isinstance(state, tuple) or len(state) != 5 or not isinstance(state[3], MemoryFormat):
            raise CorruptFileError(f"TensorProperties is pickled as {state!r}, not (dtype, layout, requires_grad, "
                                   "memory format, pin_memory)")
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state

    def __repr__(self) -> str:
        return f"TensorProperties(dtype={self.dtype!r}, layout={self.layout!r})"


class SavePlan(_Record):
    """torch.distributed.checkpoint.planner.SavePlan, as megatron-core keeps ranks' plans in the
    metadata's ``planner_data`` (which the converters never read)."""

    FIELDS = ("items", "storage_data", "planner_data", "usable")
    storage_data = None
    planner_data = None
    usable = True


class WriteItem(_Record):
    FIELDS = ("index", "type", "bytes_io_data", "tensor_data")
    bytes_io_data = None
    tensor_data = None


class TensorWriteData(_Record):
    FIELDS = ("chunk", "properties", "size")


class BytesIOWriteData(_Record):
    FIELDS = ("nbytes",)


class WriteItemType(enum.Enum):
    """torch.distributed.checkpoint.planner.WriteItemType"""

    TENSOR = 1
    SHARD = 2
    BYTE_IO = 3


def _get_layout(name: str) -> str:
    """torch.serialization._get_layout('torch.strided'): the name stands for the layout."""
    if name != "torch.strided":
        raise NeedsTorch(f"tensor layout {name}")
    return name


_DCP = "torch.distributed.checkpoint.metadata"
ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch", "Size"): _size,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("_io", "BytesIO"): io.BytesIO,  # TransformerEngine's _extra_state (in Megatron-LM's allow-list)
    ("_codecs", "encode"): _encode,
    ("torch.serialization", "_get_layout"): _get_layout,
    (_DCP, "Metadata"): Metadata,
    (_DCP, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP, "TensorProperties"): TensorProperties,
    (_DCP, "MetadataIndex"): MetadataIndex,
    (_DCP, "StorageMeta"): StorageMeta,
    (_DCP, "_MEM_FORMAT_ENCODING"): MemoryFormat,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch.distributed.checkpoint.planner", "SavePlan"): SavePlan,
    ("torch.distributed.checkpoint.planner", "WriteItem"): WriteItem,
    ("torch.distributed.checkpoint.planner", "WriteItemType"): WriteItemType,
    ("torch.distributed.checkpoint.planner", "TensorWriteData"): TensorWriteData,
    ("torch.distributed.checkpoint.planner", "BytesIOWriteData"): BytesIOWriteData,
    **{("torch", name): d for name, d in BY_NAME.items()},
    **_STORAGES,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, records: dict[str, tuple[int, int]] | None):
        super().__init__(io.BytesIO(data))
        self.records = records  # storage key -> (data offset, size) in the file; None: no storage allowed
        self.storages: dict[str, PlainStorage] = {}

    def find_class(self, module: str, name: str):
        found = ALLOWED.get((module, name))
        if found is not None:
            return found
        if module.split(".")[0] in ("torch", "builtins", "numpy") or f"{module}.{name}" in MEGATRON_GLOBALS:
            raise NeedsTorch(f"global {module}.{name}")
        raise CorruptFileError(f"the pickle names global '{module}.{name}', which is not allowed "
                               "(weights_only=True)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageKind) and isinstance(pid[2], str) and isinstance(pid[4], int)):
            raise CorruptFileError(f"persistent id {pid!r} is not a torch storage record")
        if self.records is None:
            raise CorruptFileError("the pickle refers to a storage record but has no archive")
        _, kind, key, _location, numel = pid
        if key not in self.records:
            raise CorruptFileError(f"storage record 'data/{key}' is not in the archive")
        offset, size = self.records[key]
        nbytes = numel * (kind.dtype.itemsize if kind.dtype is not None else 1)
        if nbytes > size:
            raise CorruptFileError(f"storage record 'data/{key}' holds {size} bytes, its storage {nbytes}")
        s = self.storages.setdefault(key, PlainStorage(key, kind.dtype, nbytes, offset))
        if s.dtype != kind.dtype:
            raise CorruptFileError(f"storage record 'data/{key}' is read as {s.dtype} and {kind.dtype}")
        return s


def _unpickle(data: bytes, records: dict[str, tuple[int, int]] | None, context: str) -> Any:
    """The pickle's object; a refusal is a CorruptFileError led by ``context``, NeedsTorch as it is."""
    try:
        return _Unpickler(data, records).load()
    except NeedsTorch:
        raise
    except CorruptFileError as e:
        raise CorruptFileError(f"{context}: {e}") from None
    except Exception as e:  # noqa: BLE001  (any other failure of the pickle: truncated, wrong opcodes)
        raise CorruptFileError(f"{context}: unreadable pickle: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------- the zip
def _data_offset(f, info: zipfile.ZipInfo) -> int:
    """Where a stored record's bytes start: after its local header (whose extra field, torch's
    "FB" padding, differs from the central directory's)."""
    f.seek(info.header_offset)
    head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise CorruptFileError(f"record '{info.filename}' has no local header at {info.header_offset}")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len


def load_zip(f, what: str) -> Any:
    """The object a torch.save file (a seekable binary file) holds, tensors as PlainTensors.
    Raises CorruptFileError (naming ``what``) for a file this reader refuses, NeedsTorch for
    one only torch.load can build."""
    try:
        f.seek(0)
        z = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CorruptFileError(f"'{what}' is not a readable torch checkpoint: not a zip file ({e})") from None
    try:
        infos = z.infolist()
        pkl = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
        if len(pkl) != 1:
            raise CorruptFileError(f"'{what}' is not a torch checkpoint: {len(pkl)} '<prefix>/data.pkl' records")
        prefix = pkl[0].filename[:-len("data.pkl")]
        by_name = {i.filename: i for i in infos}

        def small(name: str) -> str | None:
            i = by_name.get(prefix + name)
            return None if i is None else z.read(i).decode(errors="replace").strip()

        checks = [(".format_version", FORMAT_VERSIONS), ("version", ARCHIVE_VERSIONS), ("byteorder", {"little"})]
        for name, known in checks:
            got = small(name)
            if got is not None and got not in known:
                raise CorruptFileError(f"'{what}' has {name} '{got}'; this reader knows {sorted(known)}")
        records = {}
        for i in infos:
            if i.filename.startswith(prefix + "data/"):
                if i.compress_type != zipfile.ZIP_STORED:
                    raise CorruptFileError(f"'{what}': record '{i.filename}' is compressed")
                records[i.filename[len(prefix) + 5:]] = (_data_offset(f, i), i.file_size)
        data = z.read(pkl[0])
    except (zipfile.BadZipFile, OSError, EOFError, KeyError, ValueError) as e:
        raise CorruptFileError(f"'{what}' is not a readable torch checkpoint: {e}") from None
    return _unpickle(data, records, f"cannot load '{what}' with weights_only=True")


def load_pickle(data: bytes, what: str) -> Any:
    """A plain pickle with no storages (DCP's ``.metadata``), with the same allow-list."""
    return _unpickle(data, None, f"cannot load '{what}'")
