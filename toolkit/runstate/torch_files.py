"""One torch.save file per tensor of training state, written by the converters' streaming
writer instead of torch.save.

DeepSpeed's universal checkpoint (and the Hugging Face Trainer folder, which holds one) keeps
every state of every parameter as its own ``torch.save`` file. torch.save checksums each
record with miniz's CRC-32 (about 0.25 GB/s here) after the tensor was read into memory; this
writes the same zip (converters.formats.torch_zip: torch.save's geometry, read back by
torch.load plain and memory-mapped) with the record streamed from the runtime checkpoint's
torch_dist files (converters.stream.pieces / converters.sink.FileWriter): rows that move
unchanged are copied file to file by the kernel (copy_file_range, as ``cp`` does) and
checksummed from a map of the source (ISA-L's CRC-32) on the writer threads; only rows that
must be gathered (a column block of a row-parallel split, q/k/v out of linear_qkv) pass
through a bounded buffer. The CRC-32s are real: zipfile reads the files without complaint.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from converters.formats import torch_dist
from converters.formats.torch_pickle import TensorSpec
from toolkit.regions import Copy, as_2d, compose, whole

FP32 = "float32"


class StateSource(torch_dist.DistReader):
    """The tensors stored under ``key_prefix`` in a torch_dist folder (a distributed
    optimizer's ``optimizer.state.exp_avg.``) as a converters source of the model's global
    tensors (``supply(name)``: the copies that make global tensor ``name``). ``metadata``:
    the folder's DCP metadata when the caller has read it already (``by_prefix``)."""

    def __init__(self, d: Path, key_prefix: str, metadata=None):
        super().__init__(d, metadata=metadata)
        n = len(key_prefix)
        self.keys = {k[n:]: v for k, v in self.keys.items() if k.startswith(key_prefix)}
        self.storage = {(k[n:], off): s for (k, off), s in self.storage.items() if k.startswith(key_prefix)}
        self.stacked = torch_dist.is_stacked(self.keys)

    @classmethod
    def by_prefix(cls, d: Path, prefixes: list[str]) -> dict[str, StateSource]:
        """One source per key prefix, the folder's metadata read once."""
        from converters.errors import CorruptFileError
        from converters.formats import dcp

        try:
            md = dcp.read_metadata(d)
        except dcp.DCPError as e:
            raise CorruptFileError(str(e)) from None
        return {p: cls(d, p, md) for p in prefixes}


def optimizer_sources(opened: contextlib.ExitStack, d: Path, keys, mm) -> dict[str, StateSource]:
    """{key: the source of ``optimizer.state.<key>.``} of a runtime checkpoint's optimizer
    folder ``d``, each closed by ``opened``, its keys named as the spec of ``mm``'s model names
    them (converters.formats.torch_dist.DistReader.names_for: a gated delta net layer's input
    norm, tensors stored one key per part)."""
    found = StateSource.by_prefix(d, [f"optimizer.state.{k}." for k in keys])
    for source in found.values():
        source.names_for(mm.shape, mm.part_keys)
    return {k: opened.enter_context(found[f"optimizer.state.{k}."]) for k in keys}


def global_copies(source: StateSource, name: str, shape: tuple[int, ...]) -> list[Copy]:
    """Copies making global tensor ``name`` of ``shape`` (its 2-D view) from the stored chunks:
    fewer rows than stored (the vocabulary padding left out) take the first rows."""
    rows, cols = as_2d(shape)
    return compose([whole(name, name, rows, cols)], {name: source.supply(name)})


def hf_copies(source: StateSource, outer: list[Copy]) -> list[Copy]:
    """Copies making an HF tensor from the global tensors ``outer`` cuts it from."""
    return compose(outer, {c.src: source.supply(c.src) for c in outer})


class Writer:
    """Writes state files (``save``) on the converters' writer threads, which keep working
    from one file into the next: a file's CRC-32 is patched in and the file closed as soon as
    its chunks are written (checked after each ``save``), and when PENDING files are still
    being written the queue is drained (most state files are one or two chunks; waiting for
    each would leave the threads idle). The queued chunks read their sources' descriptors:
    leave the ``with`` block (or ``finish``) before the sources close."""

    PENDING = 64  # files queued but not yet finished (open descriptors)

    def __init__(self):
        from converters.sink import FileWriter

        self._threads = FileWriter()
        self._pending: list[tuple[int, object, object]] = []  # (fd, zip layout, ChunkCRCs)

    def save(self, path: Path, obj, spec: TensorSpec, copies: list[Copy], source: StateSource,
             progress: Callable[[int], None] | None = None) -> None:
        """``torch.save(obj, path)`` where ``obj`` holds the TensorSpec ``spec`` (its only
        tensor), whose values are ``copies`` from ``source``; ``progress(bytes)`` as they are
        queued. The file is complete after ``finish`` (or leaving the ``with`` block)."""
        from converters.errors import CorruptFileError
        from converters.formats import torch_zip
        from converters.sink import ChunkCRCs, write_target
        from converters.stream import Meter, Target

        rows, cols = as_2d(spec.shape)
        if sum(c.area for c in copies) != rows * cols:
            raise CorruptFileError(f"'{source.dir}' does not hold all of the {list(spec.shape)} values written to "
                                   f"'{path}' (its chunks cover {sum(c.area for c in copies)})")
        lay, specs = torch_zip.torch_file(obj, path.stem)
        if specs != [spec]:
            raise ValueError(f"{path}: the object must hold exactly one tensor, the given TensorSpec")
        meter = Meter(spec.nbytes, None if progress is None else increments(progress))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        crcs = ChunkCRCs()
        self._pending.append((fd, lay, crcs))
        torch_zip.write_pieces(fd, 0, lay)
        write_target(self._threads, fd, lay.data[0][0], Target(str(path), spec.shape, spec.dtype, tuple(copies)),
                     source, meter, crcs)
        self._retire()
        if len(self._pending) >= self.PENDING:
            self.finish()

    def _retire(self) -> None:
        """Finish the files whose chunks are all written."""
        from converters.formats import torch_zip

        done = [p for p in self._pending if p[2].complete()]
        self._pending = [p for p in self._pending if p not in done]
        for fd, lay, crcs in done:
            try:
                torch_zip.patch_crcs(fd, 0, lay, [crcs.value()])
            finally:
                os.close(fd)

    def finish(self) -> None:
        """Wait for every queued chunk, patch the CRC-32s in, close the files."""
        from converters.formats import torch_zip

        try:
            self._threads.flush()
            for fd, lay, crcs in self._pending:
                torch_zip.patch_crcs(fd, 0, lay, [crcs.value()])
        finally:
            self._close_files()

    def _close_files(self) -> None:
        self._threads.flush_quietly()  # no job may write to a closed (perhaps reused) descriptor
        for fd, _, _ in self._pending:
            os.close(fd)
        self._pending = []

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self._close_files()
            with contextlib.suppress(BaseException):  # the error already raised is the one to report
                self._threads.close()
            return
        try:
            self.finish()
        finally:
            self._threads.close()


def fp32(shape: tuple[int, ...]) -> TensorSpec:
    from converters.dtypes import dtype_of

    return TensorSpec(tuple(shape), dtype_of(FP32))


def increments(progress: Callable[[int], None]) -> Callable[[int, int], None]:
    done = [0]

    def report(n: int, _total: int) -> None:
        progress(n - done[0])
        done[0] = n

    return report


__all__ = ["StateSource", "Writer", "fp32", "global_copies", "hf_copies", "increments", "optimizer_sources"]
