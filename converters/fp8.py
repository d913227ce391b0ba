"""FP8 block-scaled HF weights (DeepSeek-V3's official checkpoint) dequantised while read.

Such a checkpoint stores most linear weights ``W`` as float8 e4m3 with a float32
``W_scale_inv`` of shape [ceil(rows/128), ceil(cols/128)] (``quantization_config``:
``quant_method: fp8``, ``weight_block_size: [128, 128]``). The value of element (i, j) is
``float32(W[i, j]) * W_scale_inv[i // 128, j // 128]``, rounded once to the output dtype:
the formula of DeepSeek's own ``weight_dequant`` (DeepSeek-V3 ``inference/kernel.py``,
used by ``inference/fp8_cast_bf16.py``), which transformers' ``Fp8Dequantize`` also
computes (in float32, then cast) where the blocks tile the weight exactly.

``dequantized`` wraps the HF reader: FP8 weights appear as ``dtype`` tensors (bf16 unless
asked otherwise) whose rows are dequantised as the converter streams them (a chunk of rows
at a time, in the writer thread that needs them: never a whole tensor), the scale tensors
disappear, and the returned config has no quantization_config (the converted checkpoint is
not FP8). These rows are computed, so they are never copied file to file (no ``extent``).
torch is imported only when an FP8 checkpoint is read.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .dtypes import BY_NAME, DType, bfloat16, float32
from .errors import CheckpointError, ConversionSetupError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (BY_NAME["float8_e4m3fn"],)
DEFAULT_DTYPE = bfloat16
MXFP4 = "mxfp4"


def fp8_block(config: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, cols) block of an FP8 block-scaled checkpoint, None when not quantised;
    other quantisations are refused."""
    q = config.get("quantization_config")
    if not q or q.get("quant_method") == MXFP4:  # MXFP4 experts: converters.packed dequantises them
        return None
    block = q.get("weight_block_size")
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3" or not block or len(block) != 2:
        raise ConversionSetupError(f"quantization_config {q} is not supported: only FP8 e4m3 weights with 2-D block "
                                   "scales (quant_method 'fp8', weight_block_size [r, c]) and MXFP4 packed experts "
                                   "(quant_method 'mxfp4') are dequantised")
    return int(block[0]), int(block[1])


def dequantize_rows(weight, scale, row0: int, block: tuple[int, int], dtype):
    """Rows [row0, row0 + len(weight)) of a block-scaled weight: ``weight`` its FP8 values
    (a torch float8_e4m3fn tensor, or their bytes as a [rows, cols] uint8 array), ``scale``
    (torch) the block rows from row0 // block[0] on. float32 product, one rounding to
    ``dtype``; each block row is scaled in place by its row of scales spread over the
    columns (no rows x cols matrix of scales). FP8 values become float32 through a table of
    all 256 codes made by torch's own conversion (the same floats, NaN payloads included):
    a lookup is about 4x faster than torch's element-wise conversion on CPU."""
    import torch

    br, bc = block
    codes = weight.view(torch.uint8).numpy() if isinstance(weight, torch.Tensor) else weight
    n = codes.shape[0]
    out = torch.from_numpy(_fp8_floats().take(codes))
    cols = torch.arange(codes.shape[1]) // bc
    first = row0 // br
    for b in range(first, (row0 + n - 1) // br + 1):
        a, z = max(row0, b * br) - row0, min(row0 + n, (b + 1) * br) - row0
        out[a:z].mul_(scale[b - first].to(torch.float32)[cols])
    return out.to(dtype)


_FP8_FLOATS: list = []


def _fp8_floats() -> np.ndarray:
    """float32 value of each float8_e4m3fn code 0..255, as torch converts it (made once)."""
    if not _FP8_FLOATS:
        import torch

        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        _FP8_FLOATS.append(codes.view(torch.float8_e4m3fn).to(torch.float32).numpy())
    return _FP8_FLOATS[0]


class Dequantized:
    """A stream.Source over an HF reader with FP8 weights shown dequantised (see module doc)."""

    def __init__(self, reader, block: tuple[int, int], dtype: DType):
        self.reader, self.block, self.dtype = reader, block, dtype
        names = reader.tensors
        self.scales = {n[:-len(SCALE_SUFFIX)]: n for n in names if n.endswith(SCALE_SUFFIX)}
        for weight, scale in self.scales.items():
            self._check(weight, scale)
        fp8 = [n for n in names if reader.meta(n)[1] in FP8_DTYPES and n not in self.scales]
        if fp8:
            raise CheckpointError(f"FP8 tensor '{fp8[0]}' has no '{fp8[0]}{SCALE_SUFFIX}' block scales")
        self.tensors = {n: v for n, v in names.items() if not n.endswith(SCALE_SUFFIX)}

    def _check(self, weight: str, scale: str) -> None:
        if weight not in self.reader.tensors:
            raise CheckpointError(f"'{scale}' scales a tensor '{weight}' the checkpoint does not hold")
        (shape, dt), (sshape, _) = self.reader.meta(weight), self.reader.meta(scale)
        if dt not in FP8_DTYPES or len(shape) != 2:
            raise CheckpointError(f"'{weight}' has a block scale but is {dt} of shape {list(shape)}, not a 2-D FP8 "
                                  "weight")
        want = tuple(-(-d // b) for d, b in zip(shape, self.block))
        if tuple(sshape) != want:
            raise CheckpointError(f"'{scale}' has shape {list(sshape)}, expected {list(want)} for {list(shape)} "
                                  f"in {self.block[0]}x{self.block[1]} blocks")

    def meta(self, name):
        shape, dt = self.reader.meta(name)
        return (shape, self.dtype) if name in self.scales else (shape, dt)

    def _rows(self, name, start: int, stop: int, dtype: DType):
        """Rows [start, stop) of a stored tensor as a torch tensor (a copy: the map is released)."""
        import torch

        shape, _ = self.reader.meta(name)
        data = np.frombuffer(self.reader.window(name, start, stop), dtype=np.uint8).copy()
        return torch.from_numpy(data).view(dtype.torch).view(stop - start, shape[1])

    def window(self, name, start: int, stop: int):
        """The stored bytes, or for an FP8 weight its rows dequantised (a fresh buffer)."""
        if name not in self.scales:
            return self.reader.window(name, start, stop)
        if stop <= start:
            return None
        import torch

        shape, _ = self.reader.meta(name)  # the stored codes, read from the map itself (no copy)
        weight = np.frombuffer(self.reader.window(name, start, stop), dtype=np.uint8).reshape(stop - start, shape[1])
        br = self.block[0]
        scale = self._rows(self.scales[name], start // br, (stop - 1) // br + 1, float32)
        out = dequantize_rows(weight, scale, start, self.block, self.dtype.torch)
        return memoryview(out.view(torch.uint8).numpy()).cast("B")

    def extent(self, name, start: int, stop: int):
        """Only stored bytes lie in a file; dequantised rows are computed (None)."""
        return None if name in self.scales else self.reader.extent(name, start, stop)

    def close(self) -> None:
        self.reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dequantized(config: dict[str, Any], reader, dtype: DType | None) -> tuple[dict[str, Any], Any]:
    """(config without quantization_config, a reader that dequantises) for an FP8
    block-scaled checkpoint; (config, reader) unchanged otherwise."""
    block = fp8_block(config)
    if block is None:
        return config, reader
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    return plain, Dequantized(reader, block, dtype or DEFAULT_DTYPE)

