"""A live model's weights as full Hugging Face tensors, one at a time, and an HF folder of them.

Order: the converters' HF order (``ModelMap.hf_shapes``: the embedding, then layer by layer
as the family's weight table lists them, the final norm, MTP modules, the output layer, and
last the aliases, HF tensors megatron keeps once). Each HF tensor is put together from the
rank tensors the converters' export would read (the first holder of each value), by the
rank that holds each piece at data-parallel rank 0: every rank writes its pieces into a
zeroed buffer of the full tensor and a sum over the world, on the bytes as unsigned 8-bit
integers in 16 MiB slices, assembles it (every byte has one writer, so the sum is that byte:
bit for bit, whatever the dtype). Under ZeRO-3 the pieces' parameters are gathered for that tensor only.
Peak extra memory per rank: one full HF tensor, or one bucket of them (``bucket_bytes``), plus
the gathered parameters feeding it.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..regions import Copy, as_2d
from .live import BridgeError, LiveModel

ALL = "all"
SUM_BYTES = 16 << 20  # bytes summed per collective call


def _dtypes(live: LiveModel) -> dict[str, torch.dtype]:
    """HF name -> dtype of the rank tensors it is built from, agreed by every rank (each
    knows only the tensors it holds); an HF tensor nobody holds is an error."""
    mine = {}
    for name, copies in live.routes.items():
        held = [live.held[c.src].tensor for c in copies if c.src in live.held]
        if held:
            mine[name] = str(held[0].dtype).removeprefix("torch.")
    seen: list[dict] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    merged = {k: v for d in seen for k, v in d.items()}
    missing = [n for n in live.routes if n not in merged]
    if missing:
        raise BridgeError(f"no rank holds the parts of: {', '.join(missing[:3])}")
    return {n: getattr(torch, merged[n]) for n in live.routes}


def tensor_list(model: Any, hf: Any) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF name, shape, dtype) of every tensor ``export_hf`` yields, in its order. Collective."""
    live = LiveModel(model, hf)
    dtypes = _dtypes(live)
    return [(n, live.map.hf_shapes[n], dtypes[n]) for n in live.routes]


def _mine(live: LiveModel, copies: list[Copy]) -> tuple[list, list[Copy]]:
    """(the live tensors feeding this HF tensor here, the copies this rank writes: those
    of its pieces where it is data-parallel rank 0)."""
    params, writes = [], []
    for c in copies:
        h = live.held.get(c.src)
        if h is None:
            continue
        if isinstance(h.tensor, torch.nn.Parameter) and all(h.tensor is not p for p in params):
            params.append(h.tensor)
        if dist.get_rank(group=h.group) == 0:
            writes.append(c)
    return params, writes


def _buffer_device() -> torch.device:
    """Where the sums run: NCCL sums CUDA tensors only (not run here: no GPU), gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


ALIGN = 8  # bytes: each tensor of a bucket starts where any dtype's view of it may start


def buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensors (their indices) grouped while their aligned bytes fit in
    ``bucket_bytes``; a larger tensor is a bucket of its own (0: every tensor alone)."""
    out, used = [], 0
    for i, n in enumerate(sizes):
        n = -(-n // ALIGN) * ALIGN
        if not out or used + n > bucket_bytes:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


def _fill(live: LiveModel, name: str, out: torch.Tensor) -> None:
    """This rank's pieces of HF tensor ``name`` into ``out`` (its full shape, zeros elsewhere)."""
    view = out.view(as_2d(tuple(out.shape)))
    for c in _mine(live, live.routes[name])[1]:
        src = live.held[c.src].tensor.detach()
        part = src.reshape(as_2d(tuple(src.shape)))[c.src_row:c.src_row + c.rows, c.src_col:c.src_col + c.cols]
        view[c.dst_row:c.dst_row + c.rows, c.dst_col:c.dst_col + c.cols] = part.to(out.device)


def _assemble(live: LiveModel, names: list[str], dtypes: dict, dst: int | str) -> list[torch.Tensor]:
    """The full tensors of a bucket, views into one byte buffer summed over the world."""
    from ..runtime.checkpoint import whole

    shapes = [live.map.hf_shapes[n] for n in names]
    sizes = [-(-math.prod(s) * dtypes[n].itemsize // ALIGN) * ALIGN for n, s in zip(names, shapes)]
    raw = torch.zeros(sum(sizes), dtype=torch.uint8, device=_buffer_device())
    starts = [sum(sizes[:i]) for i in range(len(names))]
    outs = [raw[a:a + math.prod(s) * dtypes[n].itemsize].view(dtypes[n]).view(s)
            for a, n, s in zip(starts, names, shapes)]
    params = list({id(p): p for n in names for p in _mine(live, live.routes[n])[0]}.values())
    with whole(params):
        for n, out in zip(names, outs):
            _fill(live, n, out)
    for start in range(0, raw.numel(), SUM_BYTES):  # in slices: the backend's own buffers stay that small
        piece = raw[start:start + SUM_BYTES]
        if dst == ALL:
            dist.all_reduce(piece, op=dist.ReduceOp.SUM)
        else:
            dist.reduce(piece, dst=dst, op=dist.ReduceOp.SUM)
    return outs


def export_hf(model: Any, hf: Any, dst: int | str = 0,
              bucket_bytes: int = 0) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield (HF name, full tensor) for every HF tensor of the live model, in the order of the
    module doc; the tensor is on CPU on rank ``dst`` (or on every rank: ``dst="all"``) and None
    elsewhere. Collective: every rank must run the iterator to its end. ``model``: a GPTModel,
    this rank's chunks, or the runtime's engine; ``hf``: the HF folder, config.json, config
    dict or ModelShape the model was built from. ``bucket_bytes``: consecutive tensors are
    assembled together up to that many bytes (fewer, larger sums; the tensors of a bucket are
    views of one buffer); 0: one tensor at a time."""
    live = LiveModel(model, hf)
    dtypes = _dtypes(live)
    names = list(live.routes)
    me = dist.get_rank()
    sizes = [math.prod(live.map.hf_shapes[n]) * dtypes[n].itemsize for n in names]
    with torch.no_grad():
        for group in buckets(sizes, bucket_bytes):
            got = _assemble(live, [names[i] for i in group], dtypes, dst)
            for i, t in zip(group, got):
                yield names[i], t.cpu() if dst == ALL or dst == me else None
            del got


def save_hf(model: Any, hf: Any, out_dir: str | Path, overwrite: bool = False,
            max_shard_size: int | str = "5GB") -> Path:
    """Write the live model as an HF folder (safetensors shards as transformers splits them,
    config.json, and the tokenizer/generation files found beside ``hf`` when it is a folder):
    rank 0 writes each tensor at its place in its shard as it arrives, in a temporary folder
    renamed into place at the end (toolkit.atomic). Collective; an error on rank 0 is raised on
    every rank, and leaves nothing behind."""
    listing = tensor_list(model, hf)
    tensors = export_hf(model, hf, dst=0)
    error: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            _write(tensors, listing, hf, Path(out_dir), overwrite, max_shard_size)
        except Exception as e:  # noqa: BLE001  reported on every rank below, once the collectives are done
            error[0] = f"{type(e).__name__}: {e}"
    for _ in tensors:  # the rest of the collectives (all of them on ranks other than 0)
        pass
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise BridgeError(f"saving to '{out_dir}' failed: {error[0]}")
    return Path(out_dir)


def _write(tensors, listing, hf: Any, out_dir: Path, overwrite: bool, max_shard_size) -> None:
    """Shards planned up front (converters.formats.hf.plan_shards), headers first, each tensor
    written at its offset (os.pwrite) as the iterator yields it."""
    import json
    from collections import Counter

    from converters.dtypes import dtype_of
    from converters.formats.hf import INDEX, copy_side_files, plan_shards, write_config
    from converters.formats.safetensors_io import header_bytes
    from converters.stream import Target

    from ..atomic import atomic_output_dir

    targets = [Target(n, tuple(s), dtype_of(d), ()) for n, s, d in listing]
    shards = plan_shards(targets, max_shard_size)
    with atomic_output_dir(out_dir, overwrite) as tmp:
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in targets)},
                     "weight_map": {t.name: f for f, ts in shards.items() for t in ts}}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        fds, place = [], {}
        try:
            for f, ts in shards.items():
                fds.append(os.open(tmp / f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
                head = header_bytes([(t.name, t.shape, t.dtype) for t in ts])
                os.pwrite(fds[-1], head, 0)
                offset = len(head)
                for t in ts:
                    place[t.name] = (fds[-1], offset)
                    offset += t.nbytes
            for name, t in tensors:
                _pwrite(*place[name], t)
        finally:
            for fd in fds:
                os.close(fd)
        write_config(tmp, _config_of(hf), Counter(t.dtype for t in targets).most_common(1)[0][0])
        side = Path(hf) if isinstance(hf, (str, Path)) else None
        copy_side_files(side.parent if side is not None and side.is_file() else side, tmp)


def _pwrite(fd: int, offset: int, t: torch.Tensor) -> None:
    data = memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _config_of(hf: Any) -> dict:
    from ..models import ModelShape, hf_config_dict, read_hf_config

    if isinstance(hf, dict):
        return hf
    return hf_config_dict(hf) if isinstance(hf, ModelShape) else read_hf_config(hf)
