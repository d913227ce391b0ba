"""HF tensors that store several of a weight table's tensors, one part per expert (GPT-OSS's
three-dimensional experts), read and written through views.

A family's ``packed`` (toolkit.models.family) lists each stored tensor with the per-expert
tensors its table names instead (``{}`` = the expert) and whether they are stored transposed:
expert e's slab of the stored tensor [E, ...] holds part k at ``[..., k::n]`` of its last axis
(n parts interleaved; n = 1: the part itself), each part as [in, out] when transposed. GPT-OSS's
``gate_up_proj`` [E, hidden, 2 ffn] holds gate_proj [ffn, hidden] at the even and up_proj at
the odd columns, transposed.

Every copy the converters plan stays a rectangle of the table's tensors (toolkit.regions): a
transpose is not one. So the stored tensors are seen through views: ``Unpacked`` shows an HF
reader's stored tensors as the table's per-expert tensors (a window of one is computed from
that expert's slab), and ``packing`` turns the per-expert targets of an export into the stored
tensors, each expert's slab computed from its parts' copies. Memory: one expert's slab and its
parts at a time (an expert of GPT-OSS-120B: 2880 x 5760 values), whatever the model size.
Bytes are moved as unsigned integers of the element size: no dtype is ever converted here,
except where the checkpoint stores the experts in MXFP4 (``quantization_config`` quant_method
mxfp4, the hub's GPT-OSS): ``{name}_blocks`` [E, out, in/32, 16] (two FP4 e2m1 values a byte,
low nibble first) and ``{name}_scales`` [E, out, in/32] (a power of two, exponent + 127, per 32
values) are dequantised an expert at a time as transformers' ``convert_moe_packed_tensors``
(integrations/mxfp4.py) computes them (its value table times 2^(scale - 127), exact in bf16) and
transposed to the stored [E, in, out] form, in bf16 unless another dtype is asked for.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from toolkit.regions import as_2d, whole

from .dtypes import bfloat16
from .errors import CheckpointError, ConversionSetupError, MissingTensorError, TensorShapeError
from .fp8 import MXFP4
from .stream import Target, _gather

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# transformers' FP4_VALUES (integrations/mxfp4.py): the e2m1 value of each 4-bit code
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_BLOCK, SCALE_BIAS = 32, 127


@dataclass(frozen=True)
class Stored:
    """One stored tensor: its name, its parts' per-expert names, experts, and the parts' shape."""

    name: str
    parts: tuple[str, ...]  # "{}" = expert
    transposed: bool
    experts: int
    part_shape: tuple[int, ...]

    @property
    def slab(self) -> tuple[int, ...]:
        """One expert's stored shape: the parts interleaved along the last axis."""
        n, s = len(self.parts), self.part_shape
        if len(s) == 1:
            return (n * s[0],)
        rows, cols = (s[1], s[0]) if self.transposed else s
        return (rows, n * cols)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.experts, *self.slab)

    def names(self) -> dict[str, tuple[int, int]]:
        """Part name -> (expert, index of the part)."""
        return {p.format(e): (e, k) for e in range(self.experts) for k, p in enumerate(self.parts)}

    def part(self, slab: np.ndarray, k: int) -> np.ndarray:
        """Part k of one expert's slab (a strided view)."""
        p = slab.reshape(self.slab)[..., k::len(self.parts)]
        return p.T if self.transposed and p.ndim == 2 else p


def stored_tensors(shape, hf_shapes: dict[str, tuple[int, ...]]) -> list[Stored]:
    """The model's stored tensors (none unless its family packs some), with the parts' shapes
    the weight table gives."""
    from toolkit.models.family import family_of

    fn = family_of(shape.architecture).packed
    if fn is None:
        return []
    out = []
    for name, parts, transposed in fn(shape):
        present = [p for p in parts if p.format(0) in hf_shapes]
        if present:
            out.append(Stored(name, parts, transposed, shape.moe.num_experts, tuple(hf_shapes[parts[0].format(0)])))
    return out


def _check_shape(reader, name: str, want: tuple[int, ...]) -> None:
    got, _ = reader.meta(name)
    if tuple(got) != tuple(want):
        raise TensorShapeError(f"tensor '{name}' has shape {list(got)}, expected {list(want)}")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray):
    """One expert's [out, in] float32 weight from its MXFP4 blocks [out, in/32, 16] (uint8) and
    scales [out, in/32] (uint8), as transformers' convert_moe_packed_tensors: code b's low
    nibble is value 2j, its high nibble value 2j + 1, times 2^(scale - 127)."""
    import torch

    b = torch.from_numpy(blocks).to(torch.long)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).reshape(*b.shape[:-1], -1)  # [out, groups, 32]
    exp = torch.from_numpy(scales).to(torch.int32) - SCALE_BIAS
    return torch.ldexp(out, exp[..., None]).reshape(b.shape[0], -1)


class Unpacked:
    """A stream.Source over an HF reader that shows each stored tensor as its parts (see the
    module doc); every other tensor is the reader's own. ``mxfp4``: the dtype the checkpoint's
    MXFP4 experts are dequantised to (None: not an MXFP4 checkpoint)."""

    def __init__(self, reader, stored: list[Stored], mxfp4=None):
        self.reader, self.parts, self._lock, self._slab = reader, {}, threading.Lock(), (None, None)
        self.quantized, self.dtypes = set(), {}
        for s in stored:
            if mxfp4 is not None and f"{s.name}_blocks" in reader.tensors:
                self._check_mxfp4(s)
                self.quantized.add(s.name)
                self.dtypes[s.name] = mxfp4
            elif s.name not in reader.tensors:
                raise MissingTensorError(f"missing tensor: {s.name}")
            else:
                _check_shape(reader, s.name, s.shape)
                self.dtypes[s.name] = reader.meta(s.name)[1]
            self.parts.update({n: (s, e, k) for n, (e, k) in s.names().items()})
        hidden = {s.name for s in stored} | {f"{n}_{x}" for n in self.quantized for x in ("blocks", "scales")}
        self.tensors = {**{n: v for n, v in reader.tensors.items() if n not in hidden}, **dict.fromkeys(self.parts)}

    def _check_mxfp4(self, s: Stored) -> None:
        """[E, in, out] stored = blocks [E, out, in/32, 16] and scales [E, out, in/32]."""
        experts, cols, rows = s.shape
        if cols % MX_BLOCK:
            raise CheckpointError(f"'{s.name}_blocks': {cols} inputs are not whole MXFP4 blocks of {MX_BLOCK}")
        if f"{s.name}_scales" not in self.reader.tensors:
            raise MissingTensorError(f"missing tensor: {s.name}_scales")
        _check_shape(self.reader, f"{s.name}_blocks", (experts, rows, cols // MX_BLOCK, MX_BLOCK // 2))
        _check_shape(self.reader, f"{s.name}_scales", (experts, rows, cols // MX_BLOCK))

    def meta(self, name):
        if name not in self.parts:
            return self.reader.meta(name)
        s, _, _ = self.parts[name]
        return s.part_shape, self.dtypes[s.name]

    def _read(self, s: Stored, e: int) -> np.ndarray:
        """Expert e's slab as elements of its dtype (MXFP4: dequantised and transposed)."""
        dtype = self.dtypes[s.name]
        if s.name not in self.quantized:
            return np.frombuffer(self.reader.window(s.name, e, e + 1), dtype=UINT[dtype.itemsize]).copy()
        _, cols, rows = s.shape
        groups = cols // MX_BLOCK
        blocks = np.frombuffer(self.reader.window(f"{s.name}_blocks", e, e + 1), dtype=np.uint8).copy()
        scales = np.frombuffer(self.reader.window(f"{s.name}_scales", e, e + 1), dtype=np.uint8).copy()
        w = dequantize_mxfp4(blocks.reshape(rows, groups, MX_BLOCK // 2), scales.reshape(rows, groups))
        import torch

        return w.T.contiguous().to(dtype.torch).view(torch.uint8).numpy().reshape(-1).view(UINT[dtype.itemsize])

    def _expert(self, s: Stored, e: int) -> np.ndarray:
        """Expert e's slab as elements (kept while the next part of the same slab is read)."""
        with self._lock:
            key, slab = self._slab
            if key != (s.name, e):
                slab = self._read(s, e)
                self._slab = ((s.name, e), slab)
            return slab

    def window(self, name, start: int, stop: int):
        if name not in self.parts:
            return self.reader.window(name, start, stop)
        if stop <= start:
            return None
        s, e, k = self.parts[name]
        rows = np.ascontiguousarray(s.part(self._expert(s, e), k)[start:stop])
        return memoryview(rows.view(np.uint8).reshape(-1))

    def extent(self, name, start: int, stop: int):
        """Stored bytes lie in a file; a part's rows are computed (None)."""
        return None if name in self.parts else self.reader.extent(name, start, stop)

    def queued(self, writer) -> None:
        fn = getattr(self.reader, "queued", None)
        if fn is not None:
            fn(writer)

    def close(self) -> None:
        self.reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def mxfp4_config(config: dict) -> tuple[dict, bool]:
    """(config without quantization_config, True) for an MXFP4 checkpoint; (config, False) else
    (the converted checkpoint is not MXFP4)."""
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != MXFP4:
        return config, False
    return {k: v for k, v in config.items() if k != "quantization_config"}, True


def unpacked(shape, reader, hf_shapes: dict[str, tuple[int, ...]], mxfp4: bool = False, dtype=None):
    """The reader as the weight table names the tensors (itself when the family packs none);
    ``mxfp4``: its packed experts are MXFP4, dequantised to ``dtype`` (default bf16)."""
    stored = stored_tensors(shape, hf_shapes)
    if mxfp4 and not stored:
        raise ConversionSetupError(f"quantization_config quant_method '{MXFP4}': only experts stored as packed "
                                   f"tensors (GPT-OSS) are dequantised, {shape.architecture} has none")
    return Unpacked(reader, stored, (dtype or bfloat16) if mxfp4 else None) if stored else reader


class Packing:
    """A stream.Source that adds the stored tensors to ``source``: expert e's slab is built from
    the targets of its parts (their copies read from ``source``)."""

    def __init__(self, source, stored: list[Stored], parts: dict[str, Target]):
        self.source, self.parts = source, parts
        self.stored = {s.name: s for s in stored}
        self.dtypes = {}
        for s in stored:
            found = {parts[n].dtype for n in s.names()}
            if len(found) != 1:
                raise TensorShapeError(f"the parts of '{s.name}' have dtypes {sorted(map(str, found))}")
            self.dtypes[s.name] = found.pop()

    def meta(self, name):
        if name in self.stored:
            return self.stored[name].shape, self.dtypes[name]
        return self.source.meta(name)

    def _part(self, target: Target) -> np.ndarray:
        rows, cols = as_2d(target.shape)
        buf = np.empty((rows, cols * target.dtype.itemsize), dtype=np.uint8)
        _gather(buf, target.dtype, 0, rows, [(c, c.dst_row, c.dst_row + c.rows) for c in target.copies], self.source)
        return buf.view(UINT[target.dtype.itemsize]).reshape(target.shape)

    def window(self, name, start: int, stop: int):
        if name not in self.stored:
            return self.source.window(name, start, stop)
        if stop <= start:
            return None
        s, size = self.stored[name], self.dtypes[name].itemsize
        out = np.empty((stop - start, *s.slab), dtype=UINT[size])
        for e in range(start, stop):
            for k, p in enumerate(s.parts):
                s.part(out[e - start], k)[...] = self._part(self.parts[p.format(e)])
        return memoryview(out.view(np.uint8).reshape(-1))

    def extent(self, name, start: int, stop: int):
        inner = getattr(self.source, "extent", None)
        return None if name in self.stored or inner is None else inner(name, start, stop)

    def queued(self, writer) -> None:
        fn = getattr(self.source, "queued", None)
        if fn is not None:
            fn(writer)

    def close(self) -> None:
        self.source.close()


def packing(shape, hf_shapes: dict[str, tuple[int, ...]], targets: list[Target], source):
    """(targets, source) of an HF export with the stored tensors in place of their parts (in
    the place of each one's first part); unchanged when the family packs none."""
    stored = stored_tensors(shape, hf_shapes)
    if not stored:
        return targets, source
    parts = {n: s for s in stored for n in s.names()}
    by_name = {t.name: t for t in targets}
    view = Packing(source, stored, {n: by_name[n] for n in parts})
    out, done = [], set()
    for t in targets:
        s = parts.get(t.name)
        if s is None:
            out.append(t)
        elif s.name not in done:
            done.add(s.name)
            rows, cols = as_2d(s.shape)
            out.append(Target(s.name, s.shape, view.dtypes[s.name], (whole(s.name, s.name, rows, cols),)))
    return out, view
