"""Megatron's legacy ``torch`` checkpoint: one ``model_optim_rng.pt`` per rank folder.

``<dir>/latest_checkpointed_iteration.txt`` ("release"), ``<dir>/release/mp_rank_{tp:02d}
[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`` holding ``args``, ``checkpoint_version`` (3.0),
``iteration`` and ``model`` (or ``model0..modelK`` for virtual pipeline chunks).

Writing streams: the whole torch.save zip is laid out first (``torch_zip``: the pickle and
every header, without torch), then each storage record is filled in place, chunk by
chunk, and its CRC-32 patched in, so the result is an ordinary torch zip file that
``torch.load(weights_only=True)`` reads. Reading finds each tensor's bytes in the zip
(the pickle and the directory only, read without torch: torch_unpickle) and copies
byte ranges from there, as from a safetensors file.
"""
from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..files import TensorInfo
from ..jobs import FileJob
from ..sink import ChunkCRCs, FileWriter, write_target
from ..stream import Meter, Source, Target
from . import torch_zip
from .torch_pickle import TensorSpec, is_tensor, load_plain, load_torch, stored

ITERATION_FILE = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
_LINEAR = re.compile(r"(^|\.)(linear_qkv|linear_proj|linear_fc1|linear_fc2|output_layer|eh_proj"
                     r"|linear_q_proj|linear_q_down_proj|linear_q_up_proj|linear_kv_down_proj|linear_kv_up_proj"
                     r"|self_attention\.in_proj|self_attention\.out_proj)$")  # the last two: gated delta nets


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


def checkpoint_dict(targets: list[Target], args: Any, vpp: int) -> tuple[dict, list[Target]]:
    """The rank file's dict with a TensorSpec for every tensor, and the targets in pickling
    order (the order of the storage records ``data/0``, ``data/1``, ...)."""
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
            model[name] = None if t is None else TensorSpec(t.shape, t.dtype)
            if t is not None:
                order.append(t)
        ckpt[model_key(vp, vpp)] = model
    return ckpt, order


def write_rank_file(path: Path, targets: list[Target], args: Any, vpp: int, source: Source, meter: Meter,
                    writer: FileWriter) -> None:
    """The zip laid out first, each record then filled in place and its CRC-32 patched in."""
    ckpt, order = checkpoint_dict(targets, args, vpp)
    lay, _ = torch_zip.torch_file(ckpt, path.stem)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        torch_zip.write_pieces(fd, 0, lay)
        crcs = [ChunkCRCs() for _ in order]
        for t, (offset, _), c in zip(order, lay.data, crcs):
            write_target(writer, fd, offset, t, source, meter, c)
        writer.flush()
        torch_zip.patch_crcs(fd, 0, lay, [c.value() for c in crcs])
    finally:
        writer.flush_quietly()
        os.close(fd)


def jobs(folder: Path, targets: list[Target], args: Any, layout) -> list[FileJob]:
    """A job per rank file of these targets, each in its rank folder under ``folder`` (made here;
    a checkpoint's ``release``, or a stage's folder: converters.staged)."""
    files: dict[tuple[int, int, int], list[Target]] = defaultdict(list)
    for t in targets:
        files[(t.name.tp, t.name.pp, t.name.ep)].append(t)
    out_jobs = []
    for (tp, pp, ep), ts in sorted(files.items()):
        d = folder / rank_dir(tp, pp, ep, layout.pp, layout.ep)
        d.mkdir(parents=True)
        out_jobs.append(FileJob(d / RANK_FILE, sum(t.nbytes for t in ts), _rank_writer(ts, args, layout.vpp)))
    return out_jobs


def _rank_writer(targets: list[Target], args: Any, vpp: int):
    def write(path: Path, source: Source, meter: Meter, writer: FileWriter) -> None:
        write_rank_file(path, targets, args, vpp, source, meter, writer)

    return write


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
    """The whole rank file, tensors memory-mapped, for megatron's own load_state_dict
    (converters.parity_worker); weights_only with megatron's safe globals."""
    return load_torch(path, str(path), meta=False)


def read_rank_file(path: Path) -> tuple[Any, list[dict[str, TensorInfo]]]:
    """(args or None, per model chunk {state-dict name: where its bytes lie}), from the pickle
    and the zip directory only, without torch (torch_pickle.load_plain). ``_extra_state``
    entries and other non-tensors are left out."""
    ckpt = load_plain(path, str(path))
    chunks = []
    for model in chunk_models(ckpt, path):
        infos = {}
        for name, t in model.items():
            if is_tensor(t):
                s = stored(t, f"{path}: {name}")
                infos[name] = TensorInfo(path, s.dtype, s.shape, s.offset)
        chunks.append(infos)
    return ckpt.get("args"), chunks


def chunk_models(ckpt: dict, path: Path) -> list[dict]:
    """[model] or [model0, model1, ...] of a rank file."""
    if "model" in ckpt:
        return [ckpt["model"]]
    keys = sorted((k for k in ckpt if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    if not keys:
        raise CheckpointError(f"'{path}' holds no 'model' entry (keys: {', '.join(map(str, ckpt))})")
    return [ckpt[k] for k in keys]
