"""Megatron's legacy ``torch`` checkpoint: one ``model_optim_rng.pt`` per rank folder.

``<dir>/latest_checkpointed_iteration.txt`` ("release"), ``<dir>/release/mp_rank_{tp:02d}
[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`` holding ``args``, ``checkpoint_version`` (3.0),
``iteration`` and ``model`` (or ``model0..modelK`` for virtual pipeline chunks).

Writing streams: the file layout is written by torch.save itself from placeholder tensors
whose memory is never touched (``torch.serialization.skip_data``), then each storage
record is filled in place, chunk by chunk, and its CRC-32 patched into the zip's data
descriptor and central directory, so the result is an ordinary torch zip file that
``torch.load(weights_only=True)`` reads.
"""
from __future__ import annotations

import math
import mmap
import os
import pickle
import re
import struct
import sys
import zipfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, CorruptFileError
from ..sink import ChunkCRCs, FileWriter, write_target
from ..stream import Meter, Source, Target

ITERATION_FILE = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
_LINEAR = re.compile(r"(^|\.)(linear_qkv|linear_proj|linear_fc1|linear_fc2|output_layer|eh_proj"
                     r"|linear_q_proj|linear_q_down_proj|linear_q_up_proj|linear_kv_down_proj|linear_kv_up_proj)$")


def rank_dir(tp: int, pp: int, ep: int, pp_size: int, ep_size: int) -> str:
    return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pp_size > 1 else "") + (f"_{ep:03d}" if ep_size > 1 else "")


def model_key(vp: int, vpp: int) -> str:
    return "model" if vpp == 1 else f"model{vp}"


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0]


def linear_modules(names: list[str]) -> list[str]:
    """megatron linear layers among these parameter names (they carry an ``_extra_state``)."""
    return list(dict.fromkeys(_module(n) for n in names if _LINEAR.search(_module(n))))


def with_extra_states(names: list[str]) -> list[str]:
    """megatron's linear layers add ``<module>._extra_state`` (None without TE) after their
    parameters; the state dict of a real GPTModel has them, so strict loading needs them."""
    out = []
    for i, name in enumerate(names):
        out.append(name)
        mod = _module(name)
        last = i + 1 == len(names) or _module(names[i + 1]) != mod
        if last and _LINEAR.search(mod):
            out.append(f"{mod}._extra_state")
    return out


_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def untouched(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor whose memory is never touched: an anonymous map reserved lazily
    (MAP_NORESERVE), so it costs neither resident memory nor, under the default overcommit
    policy, commit charge. torch.save under ``skip_data`` records its storage without
    reading it, exactly as it records a fake tensor's."""
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
    return torch.frombuffer(m, dtype=dtype).view(shape)


def _fake(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(shape, dtype=dtype)


def checkpoint_dict(targets: list[Target], args: Any, vpp: int) -> tuple[dict, list[Target]]:
    """The rank file's dict with placeholder tensors (``untouched``; fake tensors where the
    system refuses even reserved maps: strict overcommit), and the targets in pickling order
    (the order torch.save numbers the storage records ``data/0``, ``data/1``, ...)."""
    try:
        return _checkpoint_dict(targets, args, vpp, untouched)
    except OSError:
        return _checkpoint_dict(targets, args, vpp, _fake)


def _checkpoint_dict(targets: list[Target], args: Any, vpp: int, placeholder) -> tuple[dict, list[Target]]:
    by_chunk: dict[int, dict[str, Target]] = defaultdict(dict)
    for t in targets:
        by_chunk[t.name.vp][t.name.name] = t
    ckpt: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}
    order = []
    for vp in range(vpp):
        chunk = by_chunk.get(vp, {})
        model = {}
        for name in with_extra_states(list(chunk)):
            t = chunk.get(name)
            model[name] = None if t is None else placeholder(t.shape, t.dtype)
            if t is not None:
                order.append(t)
        ckpt[model_key(vp, vpp)] = model
    return ckpt, order


def _records(path: Path) -> dict[str, tuple[int, int, int]]:
    """storage key -> (data offset, size, central-directory entry offset), each record
    checked to be followed by a data descriptor (where its CRC-32 goes)."""
    out = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        central = z.start_dir
        for info in z.infolist():
            f.seek(info.header_offset + 26)
            n, m = struct.unpack("<HH", f.read(4))
            f.seek(central)
            cn, cm, ck = struct.unpack("<HHH", f.read(46)[28:34])
            if "/data/" in info.filename:
                offset = info.header_offset + 30 + n + m
                f.seek(offset + info.file_size)
                if f.read(4) != b"PK\x07\x08":
                    raise RuntimeError(f"{path}: record {info.filename} has no data descriptor for its CRC")
                out[info.filename.rsplit("/", 1)[1]] = (offset, info.file_size, central)
            central += 46 + cn + cm + ck
    return out


def _patch_crc(fd: int, crc: int, offsets: tuple[int, ...]) -> None:
    for at in offsets:
        os.pwrite(fd, struct.pack("<I", crc), at)


def write_rank_file(path: Path, targets: list[Target], args: Any, vpp: int, source: Source, meter: Meter,
                    writer: FileWriter) -> None:
    """torch.save writes the layout (placeholder tensors, no data); each record is then filled in
    place and its CRC-32 written to its data descriptor and central-directory entry."""
    ckpt, order = checkpoint_dict(targets, args, vpp)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(ckpt, path)
    records = _records(path)
    if len(records) != len(order):
        raise RuntimeError(f"{path}: {len(records)} storage records for {len(order)} tensors")
    fd = os.open(path, os.O_WRONLY)
    try:
        crcs = []
        for i, t in enumerate(order):
            offset, size, central = records[str(i)]
            if size != t.nbytes:
                raise RuntimeError(f"{path}: record {i} has {size} bytes, '{t.name.name}' needs {t.nbytes}")
            crcs.append((ChunkCRCs(), (offset + size + 4, central + 16)))
            write_target(writer, fd, offset, t, source, meter, crcs[-1][0])
        writer.flush()
        for parts, at in crcs:
            _patch_crc(fd, parts.value(), at)
    finally:
        writer.flush_quietly()
        os.close(fd)


def write_checkpoint(out: Path, targets: list[Target], args: Any, layout, source: Source, meter: Meter) -> None:
    """All rank folders of a legacy checkpoint under ``out/release``."""
    (out / ITERATION_FILE).write_text("release\n")
    files: dict[tuple[int, int, int], list[Target]] = defaultdict(list)
    for t in targets:
        files[(t.name.tp, t.name.pp, t.name.ep)].append(t)
    with FileWriter() as writer:
        for (tp, pp, ep), ts in sorted(files.items()):
            d = out / "release" / rank_dir(tp, pp, ep, layout.pp, layout.ep)
            d.mkdir(parents=True)
            write_rank_file(d / RANK_FILE, ts, args, layout.vpp, source, meter, writer)


# ---------------------------------------------------------------------------- reading
_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def iteration_dir(path: Path) -> Path:
    """The folder holding the rank folders (or torch_dist files) of a checkpoint."""
    marker = path / ITERATION_FILE
    if not marker.is_file():
        return path
    text = marker.read_text().strip()
    d = path / ("release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else text)
    if not d.is_dir():
        raise CheckpointError(f"{marker} names iteration '{text}' but '{d}' does not exist")
    return d


def rank_folders(d: Path) -> dict[tuple[str, ...], Path]:
    """mp_rank folder name parts ('00', '001', ...) -> its model_optim_rng.pt."""
    out = {}
    for p in sorted(d.iterdir()):
        m = _RANK.match(p.name)
        if m and p.is_dir():
            if not (p / RANK_FILE).is_file():
                raise CheckpointError(f"rank folder '{p}' has no {RANK_FILE}")
            out[tuple(g for g in m.groups() if g is not None)] = p / RANK_FILE
    return out


def load_rank_file(path: Path) -> dict:
    """torch.load with weights_only (no code runs from the pickle), megatron's safe globals
    allowed (argparse.Namespace, its enums), tensors memory-mapped rather than read."""
    globals_ = _safe_globals()
    try:
        with torch.serialization.safe_globals(globals_):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CorruptFileError(f"cannot load '{path}' with weights_only=True: {str(e).splitlines()[0]}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile) as e:
        raise CorruptFileError(f"'{path}' is not a readable torch checkpoint: {str(e).splitlines()[0]}") from None


def _safe_globals() -> list:
    try:
        from megatron.core.safe_globals import SAFE_GLOBALS
    except ImportError:  # pragma: no cover - megatron-core is a dependency
        import argparse
        import types

        SAFE_GLOBALS = [argparse.Namespace, types.SimpleNamespace]
    return list(SAFE_GLOBALS)


def chunk_models(ckpt: dict, path: Path) -> list[dict]:
    """[model] or [model0, model1, ...] of a rank file."""
    if "model" in ckpt:
        return [ckpt["model"]]
    keys = sorted((k for k in ckpt if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    if not keys:
        raise CheckpointError(f"'{path}' holds no 'model' entry (keys: {', '.join(map(str, ckpt))})")
    return [ckpt[k] for k in keys]
