"""FP8 block-scaled HF weights (DeepSeek-V3's official checkpoint) dequantised while read.

Such a checkpoint stores most linear weights ``W`` as float8 e4m3 with a float32
``W_scale_inv`` of shape [ceil(rows/128), ceil(cols/128)] (``quantization_config``:
``quant_method: fp8``, ``weight_block_size: [128, 128]``). The value of element (i, j) is
``float32(W[i, j]) * W_scale_inv[i // 128, j // 128]``, rounded once to the output dtype:
the formula of DeepSeek's own ``weight_dequant`` (DeepSeek-V3 ``inference/kernel.py``,
used by ``inference/fp8_cast_bf16.py``), which transformers' ``Fp8Dequantize`` also
computes (in float32, then cast) where the blocks tile the weight exactly.

``dequantized`` wraps the HF reader: FP8 weights appear as ``dtype`` tensors (bf16 unless
asked otherwise) whose rows are dequantised block row by block row as the converter streams
them, the scale tensors disappear, and the returned config has no quantization_config
(the converted checkpoint is not FP8).
"""
from __future__ import annotations

from typing import Any

import torch

from .errors import CheckpointError, ConversionSetupError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)
DEFAULT_DTYPE = torch.bfloat16


def fp8_block(config: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, cols) block of an FP8 block-scaled checkpoint, None when not quantised;
    other quantisations are refused."""
    q = config.get("quantization_config")
    if not q:
        return None
    block = q.get("weight_block_size")
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3" or not block or len(block) != 2:
        raise ConversionSetupError(f"quantization_config {q} is not supported: only FP8 e4m3 weights with 2-D block "
                                   "scales (quant_method 'fp8', weight_block_size [r, c]) are dequantised")
    return int(block[0]), int(block[1])


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor, row0: int, block: tuple[int, int],
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows [row0, row0 + len(weight)) of a block-scaled weight; ``scale`` holds the block
    rows from row0 // block[0] on. float32 product, one rounding to ``dtype``."""
    br, bc = block
    rows = torch.arange(row0, row0 + weight.shape[0]) // br - row0 // br
    cols = torch.arange(weight.shape[1]) // bc
    return (weight.to(torch.float32) * scale.to(torch.float32)[rows][:, cols]).to(dtype)


class Dequantized:
    """A stream.Source over an HF reader with FP8 weights shown dequantised (see module doc)."""

    def __init__(self, reader, block: tuple[int, int], dtype: torch.dtype):
        self.reader, self.block, self.dtype = reader, block, dtype
        names = reader.tensors
        self.scales = {n[:-len(SCALE_SUFFIX)]: n for n in names if n.endswith(SCALE_SUFFIX)}
        for weight, scale in self.scales.items():
            self._check(weight, scale)
        fp8 = [n for n in names if names[n].dtype in FP8_DTYPES and n not in self.scales]
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

    def rows(self, name, start: int, stop: int) -> torch.Tensor:
        if name not in self.scales:
            return self.reader.rows(name, start, stop)
        weight = self.reader.rows(name, start, stop).clone()  # the reader reuses its buffer
        br = self.block[0]
        scale = self.reader.rows(self.scales[name], start // br, (stop - 1) // br + 1)
        return dequantize_rows(weight, scale, start, self.block, self.dtype)

    def window(self, name, start: int, stop: int):
        return None if name in self.scales else self.reader.window(name, start, stop)

    def extent(self, name, start: int, stop: int):
        return self.reader.extent(name, start, stop)

    def close(self) -> None:
        self.reader.close()


def dequantized(config: dict[str, Any], reader, dtype: torch.dtype | None) -> tuple[dict[str, Any], Any]:
    """(config without quantization_config, a reader that dequantises) for an FP8
    block-scaled checkpoint; (config, reader) unchanged otherwise."""
    block = fp8_block(config)
    if block is None:
        return config, reader
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    return plain, Dequantized(reader, block, dtype or DEFAULT_DTYPE)

