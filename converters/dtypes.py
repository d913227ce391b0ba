"""Element types of checkpoint tensors, without importing torch.

Conversion moves bytes; it needs a tensor's element size, its names in the safetensors
header and in a torch pickle (``torch.bfloat16``, ``torch.BFloat16Storage``), and nothing
else, so the common path (HF -> legacy Megatron, same dtype) never imports torch (about
2 s of start-up on a small machine). torch is imported only to cast between dtypes
(``DType.torch``) and by the readers of torch pickles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from toolkit.parallel.precision import PRECISION_DTYPES


@dataclass(frozen=True)
class DType:
    name: str  # torch's attribute name: torch.<name>
    itemsize: int
    safetensors: str  # the header's "dtype"
    storage: str | None  # torch's legacy storage class, as torch.save names a storage's type (None:
    # torch.save writes an UntypedStorage and passes the dtype to _rebuild_tensor_v3)

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a contiguous tensor of this dtype and ``shape``."""
        return self.itemsize * math.prod(shape)

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    __str__ = __repr__

    @property
    def torch(self):
        """The torch.dtype (imports torch)."""
        import torch

        return getattr(torch, self.name)


_ALL = (
    DType("bfloat16", 2, "BF16", "BFloat16Storage"),
    DType("float16", 2, "F16", "HalfStorage"),
    DType("float32", 4, "F32", "FloatStorage"),
    DType("float64", 8, "F64", "DoubleStorage"),
    DType("int64", 8, "I64", "LongStorage"),
    DType("int32", 4, "I32", "IntStorage"),
    DType("int16", 2, "I16", "ShortStorage"),
    DType("int8", 1, "I8", "CharStorage"),
    DType("uint8", 1, "U8", "ByteStorage"),
    DType("bool", 1, "BOOL", "BoolStorage"),
    DType("float8_e4m3fn", 1, "F8_E4M3", None),
    DType("float8_e5m2", 1, "F8_E5M2", None),
)
BY_NAME = {d.name: d for d in _ALL}
BY_SAFETENSORS = {d.safetensors: d for d in _ALL}
ALIASES = {**PRECISION_DTYPES, "half": "float16", "float": "float32", "fp64": "float64", "double": "float64"}
bfloat16, float16, float32 = BY_NAME["bfloat16"], BY_NAME["float16"], BY_NAME["float32"]


def dtype_of(x: Any) -> DType:
    """A DType from a DType, a torch.dtype or a name ('bf16', 'bfloat16', 'torch.bfloat16');
    ValueError for anything else."""
    if isinstance(x, DType):
        return x
    name = str(x).removeprefix("torch.")
    name = ALIASES.get(name, name)
    if name not in BY_NAME:
        raise ValueError(f"unknown dtype '{x}'")
    return BY_NAME[name]
