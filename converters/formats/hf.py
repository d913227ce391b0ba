"""Hugging Face model folders: safetensors shards + index.json + config.json
(+ generation_config.json and tokenizer files, copied when present)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from toolkit.models import read_hf_config

from ..dtypes import DType
from ..errors import CheckpointError, CorruptFileError
from ..files import FileTensors
from ..jobs import FileJob
from ..sink import FileWriter, write_target
from ..stream import Meter, Source, Target
from .safetensors_io import header_bytes, read_header

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files that travel with the weights (not weights themselves).
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
              "chat_template.json")
MAX_SHARD = "5GB"


def open_hf(hf_dir: str | Path) -> tuple[dict[str, Any], FileTensors]:
    """(config.json, a reader over all its safetensors shards), checking the index."""
    d = Path(hf_dir)
    if not d.is_dir():
        raise CheckpointError(f"HF model folder '{d}' does not exist")
    config = read_hf_config(d)
    if (d / INDEX).is_file():
        return config, FileTensors(_indexed(d), str(d))
    if (d / SINGLE).is_file():
        return config, FileTensors(read_header(d / SINGLE), str(d))
    found = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".safetensors"))
    raise CheckpointError(f"no {SINGLE} or {INDEX} in '{d}'" + (f" (found {', '.join(found)}; only safetensors "
                                                                   "checkpoints are read)" if found else ""))


def _indexed(d: Path) -> dict:
    try:
        weight_map = json.loads((d / INDEX).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CorruptFileError(f"'{d / INDEX}' is not a valid index ({e.__class__.__name__})") from None
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        if not (d / shard).is_file():
            raise CheckpointError(f"{INDEX} names shard '{shard}', which is not in '{d}'")
        header = read_header(d / shard)
        for name in (n for n, s in weight_map.items() if s == shard):
            if name not in header:
                raise CorruptFileError(f"{INDEX} puts tensor '{name}' in '{shard}', which does not hold it")
            tensors[name] = header[name]
    return tensors


def plan_shards(targets: list[Target], max_shard_size: int | str) -> dict[str, list[Target]]:
    """File name -> its tensors, as transformers would split them: huggingface_hub's
    split_torch_state_dict_into_shards is this factory with torch's storage size (a fresh
    tensor's bytes) and no storage id (meta tensors have none), and would import torch and
    DTensor (about 3 s) to learn what ``Target.nbytes`` says."""
    from huggingface_hub import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory({t.name: t for t in targets}, get_storage_size=lambda t: t.nbytes,
                                                 filename_pattern="model{suffix}.safetensors",
                                                 max_shard_size=max_shard_size)
    by_name = {t.name: t for t in targets}
    return {f: [by_name[n] for n in names] for f, names in split.filename_to_tensors.items()}


def write_shard(path: Path, targets: list[Target], offset: int, source: Source, meter: Meter,
                writer: FileWriter) -> None:
    """``targets`` streamed in back to back from ``offset`` of the shard ``path``, which
    ``weight_jobs`` created (header written, full size): several jobs may fill one shard."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for t in targets:
            write_target(writer, fd, offset, t, source, meter)
            offset += t.nbytes
        writer.flush()
    finally:
        writer.flush_quietly()
        os.close(fd)


def runs(targets: list[Target], parts: int) -> list[list[Target]]:
    """``targets`` cut into at most ``parts`` consecutive runs of about equal bytes."""
    total, out, cur, done = sum(t.nbytes for t in targets), [], [], 0
    for t in targets:
        cur.append(t)
        done += t.nbytes
        if done * parts >= total * (len(out) + 1) and len(out) < parts - 1:
            out.append(cur)
            cur = []
    return [r for r in [*out, cur] if r]


def weight_jobs(out: Path, targets: list[Target], max_shard_size: int | str = MAX_SHARD,
                workers: int = 1) -> list[FileJob]:
    """Jobs that write the safetensors shards; the index (when there are several) is written
    here, and every shard created with its header at its full size. With fewer shards than
    ``workers``, each shard is cut into runs of tensors, one job each, so that the workers
    share a one-shard model instead of one of them writing it all."""
    shards = plan_shards(targets, max_shard_size)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in targets)},
                 "weight_map": {t.name: f for f, ts in shards.items() for t in ts}}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    parts = -(-workers // len(shards))
    jobs = []
    for f, ts in shards.items():
        offset = _create_shard(out / f, ts)
        for run in runs(ts, parts):
            jobs.append(FileJob(out / f, sum(t.nbytes for t in run), _shard_writer(run, offset)))
            offset += sum(t.nbytes for t in run)
    return jobs


def _create_shard(path: Path, targets: list[Target]) -> int:
    """The shard file with its header, at its full size; returns where the first tensor goes."""
    head = header_bytes([(t.name, t.shape, t.dtype) for t in targets])
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + sum(t.nbytes for t in targets))
    return len(head)


def _shard_writer(targets: list[Target], offset: int):
    def write(path: Path, source: Source, meter: Meter, writer: FileWriter) -> None:
        write_shard(path, targets, offset, source, meter, writer)

    return write


def write_config(out: Path, config: dict[str, Any], dtype: DType) -> None:
    """config.json with the dtype the weights were written in."""
    cfg = dict(config)
    name = dtype.name
    cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def copy_side_files(src: Path | None, out: Path) -> list[str]:
    """generation_config.json and tokenizer files from ``src`` (when it is a folder)."""
    if src is None or not src.is_dir():
        return []
    copied = [n for n in SIDE_FILES if (src / n).is_file()]
    for n in copied:
        shutil.copy2(src / n, out / n)
    return copied
