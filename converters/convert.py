"""hf_to_megatron, megatron_to_hf, megatron_to_megatron: plan the copies, then stream them.

Each function validates everything first (architecture, layout rules, every source tensor
present with the right shape, output folder free), then writes into a temporary folder
that is renamed into place at the end (toolkit.atomic): an error or interruption leaves
no output behind. The output is a list of independent files (``jobs.FileJob``), written
by this process or, with ``workers`` > 1, by that many forked processes.
"""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from toolkit.atomic import atomic_output_dir, check_output_dir
from toolkit.backends.megatron import padded_vocab
from toolkit.models import hf_config_dict, read_hf_config, shape_from_hf
from toolkit.models.family import check_supported, with_mtp
from toolkit.parallel.layout import Layout
from toolkit.regions import compose, whole

from . import jobs, staged
from .dtypes import DType, dtype_of
from .errors import CheckpointError, ConversionSetupError
from .formats import hf, torch_legacy
from .formats.torch_dist_write import Piece
from .fp8 import dequantized
from .layout import validate_layout
from .mapping import ModelMap, through_hf, to_ranks
from .megatron_args import VOCAB_DIVISOR, megatron_args
from .packed import mxfp4_config, packing, unpacked
from .shifted import hf_shifts, megatron_shift_patterns, shifted
from .staged import parse_stages
from .stream import CHUNK_BYTES, Meter, Progress, Target, cast, check_sources, target_dtype

FORMATS = ("torch", "torch_dist")
IGNORED_HF = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry; recomputed by every model


def parse_dtype(dtype: str | DType | Any | None) -> DType | None:
    """None, or the DType of a name ('bf16', 'fp32', ...) or a torch.dtype."""
    if dtype is None:
        return None
    try:
        return dtype_of(dtype)
    except ValueError:
        raise ConversionSetupError(f"unknown dtype '{dtype}'; use bf16, fp16 or fp32") from None


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ConversionSetupError(f"unknown format '{fmt}'; use {' or '.join(FORMATS)}")
    return fmt


def _check_workers(workers: int) -> int:
    if workers < 1:
        raise ConversionSetupError(f"workers={workers}: use 1 or more")
    return workers


def _check_hf_extras(names, mm: ModelMap) -> None:
    """An HF tensor the table does not place would be silently dropped: refuse."""
    for name in names:
        tied_head = name == "lm_head.weight" and mm.shape.tie_embeddings
        if name not in mm.hf_shapes and not tied_head and not name.endswith(IGNORED_HF):
            raise CheckpointError(f"unexpected tensor '{name}' in the HF checkpoint: {mm.shape.architecture} "
                                  "as converted has no place for it")


def _check_aliases(mm: ModelMap, reader) -> None:
    """An HF alias (a copy megatron keeps once, e.g. an MTP module's embed_tokens) must equal
    its original, else dropping it would change the model: compared as bytes, a chunk of
    rows at a time (a map of those rows each, released before the next)."""
    import numpy as np

    from toolkit.regions import as_2d

    for alias, of in mm.aliases.items():
        (shape, a_dtype), (_, o_dtype) = reader.meta(alias), reader.meta(of)
        rows, cols = as_2d(tuple(shape))
        step = max(1, CHUNK_BYTES // max(1, cols * max(a_dtype.itemsize, o_dtype.itemsize)))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            a, o = reader.window(alias, r0, r1), reader.window(of, r0, r1)
            if a is None or o is None:
                continue
            if a_dtype != o_dtype:
                a = cast(np.frombuffer(a, dtype=np.uint8).reshape(r1 - r0, -1), a_dtype, o_dtype).reshape(-1)
            same = bytes(a) == bytes(o) if a_dtype != o_dtype else a == o
            del a, o
            if not same:
                raise CheckpointError(f"'{alias}' differs from '{of}', which megatron-core shares with it; the "
                                      "checkpoint cannot be converted without changing the model")


def _targets(mm: ModelMap, pairs, source, dtype: DType | None) -> list[Target]:
    return [Target(rt.key, rt.shape, target_dtype(cs, source, mm.dtype_for(rt.copies[0].src, dtype), rt.key),
                   tuple(cs)) for rt, cs in pairs]


def _pieces(mm: ModelMap, layout: Layout, supply: dict, source, dtype, grouped_gemm: bool) -> list[Target]:
    """torch_dist: each distinct chunk of a global tensor that some rank holds."""
    seen, out = set(), []
    for rt in mm.rank_tensors(layout, grouped_gemm, legacy=False):
        for c in rt.copies:
            key = (c.src, c.src_row, c.src_col, c.rows, c.cols)
            if key in seen:
                continue
            seen.add(key)
            nd = len(mm.global_shapes[c.src])
            piece = Piece(c.src, c.src_row, c.src_col, (c.rows,) if nd == 1 else (c.rows, c.cols))
            copies = compose([whole(c.src, piece, c.rows, c.cols, src_row=c.src_row, src_col=c.src_col)], supply)
            out.append(Target(piece, piece.shape, target_dtype(copies, source, mm.dtype_for(c.src, dtype), c.src),
                              tuple(copies)))
    return out


def _megatron_targets(mm: ModelMap, layout: Layout, supply: dict, source, *, fmt: str, dtype: DType | None,
                      grouped_gemm: bool) -> tuple[list[Target], Any]:
    """(what to write: rank tensors or torch_dist pieces, the checkpoint's args)."""
    if fmt == "torch":
        targets = _targets(mm, to_ranks(mm, layout, supply, grouped_gemm), source, dtype)
    else:
        targets = _pieces(mm, layout, supply, source, dtype, grouped_gemm)
    main = Counter(t.dtype for t in targets).most_common(1)[0][0]
    return targets, megatron_args(mm.shape, layout, dtype=main, fmt=fmt, grouped_gemm=grouped_gemm)


def _megatron_jobs(out: Path, mm: ModelMap, layout: Layout, supply: dict, source, *, fmt: str,
                   dtype: DType | None, grouped_gemm: bool, workers: int):
    """(file jobs, the step that completes the folder after them, total bytes)."""
    from .formats.torch_legacy import ITERATION_FILE

    targets, args = _megatron_targets(mm, layout, supply, source, fmt=fmt, dtype=dtype, grouped_gemm=grouped_gemm)
    total = sum(t.nbytes for t in targets)
    (out / ITERATION_FILE).write_text("release\n")
    if fmt == "torch":
        return torch_legacy.jobs(out / "release", targets, args, layout), None, total
    from .formats import torch_dist_write

    (out / "release").mkdir()
    file_jobs, finish = torch_dist_write.plan(out / "release", torch_dist_write.model_items(mm, targets), args, workers)
    return file_jobs, finish, total


def _write(file_jobs, finish, source, total: int, progress: Progress | None, workers: int) -> None:
    """The files, then ``finish``; what finish imports (torch and DCP for torch_dist's
    .metadata: seconds) is imported while the files are written."""
    jobs.run(file_jobs, source, Meter(total, progress), workers, getattr(finish, "prepare", None))
    if finish is not None:
        finish()


def hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, vpp: int = 1,
                   ep: int = 1, etp: int | None = None, fmt: str = "torch", dtype: str | DType | None = None,
                   grouped_gemm: bool = False, overwrite: bool = False, progress: Progress | None = None,
                   workers: int = 1, first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                   embedding_in_split: bool = False, loss_in_split: bool = False,
                   stages: str | tuple[int, int] | None = None) -> Path:
    """Convert an HF model folder into a Megatron checkpoint at this layout. Returns out_dir.
    FP8 block-scaled weights (DeepSeek-V3's) are dequantised on the way, to ``dtype`` or bf16
    (converters.fp8). ``first_stage_layers`` ... ``loss_in_split``: megatron's uneven pipeline
    split (toolkit.parallel.layout.Layout). ``stages`` ("A" or "A-B"): only those pipeline
    stages' files, into a folder other commands fill with the others (converters.staged)."""
    fmt, dtype, workers = _check_format(fmt), parse_dtype(dtype), _check_workers(workers)
    picked = None if stages is None else parse_stages(stages, pp)
    if picked is None:
        check_output_dir(out_dir, overwrite)
    config, reader = hf.open_hf(hf_dir)
    with reader:
        check_supported((config.get("architectures") or ["(none)"])[0])
        config, reader = dequantized(config, reader, dtype)
        config, mxfp4 = mxfp4_config(config)
        shape = with_mtp(shape_from_hf(config), reader.tensors, hf=True)
        layout = Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, first_stage_layers=first_stage_layers,
                        last_stage_layers=last_stage_layers, embedding_in_split=embedding_in_split,
                        loss_in_split=loss_in_split)
        validate_layout(shape, layout)
        mm = ModelMap(shape, padded_vocab(shape.vocab_size, tp, VOCAB_DIVISOR))
        reader = shifted(unpacked(shape, reader, mm.hf_shapes, mxfp4, dtype), hf_shifts(mm))
        check_sources(mm.hf_shapes, reader.meta)
        _check_hf_extras(reader.tensors, mm)
        _check_aliases(mm, reader)
        if picked is not None:
            targets, args = _megatron_targets(mm, layout, mm.hf_to_global, reader, fmt=fmt, dtype=dtype,
                                              grouped_gemm=grouped_gemm)
            staged.convert(Path(out_dir).absolute(), picked, mm, layout, targets, args, reader, fmt=fmt,
                           grouped_gemm=grouped_gemm, overwrite=overwrite, progress=progress, workers=workers,
                           side=lambda d: _save_side_files(Path(hf_dir), d, config))
            return Path(out_dir)
        with atomic_output_dir(out_dir, overwrite) as tmp:
            file_jobs, finish, total = _megatron_jobs(tmp, mm, layout, mm.hf_to_global, reader, fmt=fmt,
                                                      dtype=dtype, grouped_gemm=grouped_gemm, workers=workers)
            _write(file_jobs, finish, reader, total, progress, workers)
            _save_side_files(Path(hf_dir), tmp / "hf", config)
    return Path(out_dir)


def _save_side_files(src: Path | None, side: Path, config: dict[str, Any]) -> None:
    side.mkdir(exist_ok=True)
    (side / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf.copy_side_files(src, side)


def _hf_config_arg(hf_config: str | Path | dict | None) -> tuple[dict | None, Path | None]:
    if hf_config is None or isinstance(hf_config, dict):
        return hf_config, None
    p = Path(hf_config)
    return read_hf_config(p), p if p.is_dir() else p.parent


def megatron_to_hf(megatron_dir: str | Path, out_dir: str | Path, *, hf_config: str | Path | dict | None = None,
                   dtype: str | DType | None = None, overwrite: bool = False, progress: Progress | None = None,
                   max_shard_size: int | str = hf.MAX_SHARD, workers: int = 1) -> Path:
    """Export a Megatron checkpoint (legacy torch or torch_dist, any layout) to an HF folder."""
    from .formats.megatron import open_megatron

    check_output_dir(out_dir, overwrite)
    dtype, workers = parse_dtype(dtype), _check_workers(workers)
    cfg, cfg_dir = _hf_config_arg(hf_config)
    ck = open_megatron(megatron_dir, cfg)
    with ck.source:
        routes = {name: compose(copies, ck.supply) for name, copies in ck.map.global_to_hf.items()}
        targets = [Target(n, s, target_dtype(routes[n], ck.source, ck.map.dtype_for(n, dtype), n), tuple(routes[n]))
                   for n, s in ck.map.hf_shapes.items()]
        main = Counter(t.dtype for t in targets).most_common(1)[0][0]
        source = shifted(ck.source, {}, megatron_shift_patterns(ck.map))
        targets, source = packing(ck.shape, ck.map.hf_shapes, targets, source)
        with atomic_output_dir(out_dir, overwrite) as tmp:
            file_jobs = hf.weight_jobs(tmp, targets, max_shard_size, workers)
            _write(file_jobs, None, source, sum(t.nbytes for t in targets), progress, workers)
            hf.write_config(tmp, cfg or hf_config_dict(ck.shape), main)
            hf.copy_side_files(ck.side_dir or cfg_dir, tmp)
    return Path(out_dir)


def megatron_to_megatron(src: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, vpp: int = 1,
                         ep: int = 1, etp: int | None = None, fmt: str | None = None,
                         dtype: str | DType | None = None, grouped_gemm: bool | None = None,
                         overwrite: bool = False, progress: Progress | None = None, workers: int = 1,
                         first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                         embedding_in_split: bool = False, loss_in_split: bool = False) -> Path:
    """Reshard (tp/pp/vpp/ep/etp, even or uneven pipeline split) and/or change the format;
    values move file to file."""
    from .formats.megatron import open_megatron

    check_output_dir(out_dir, overwrite)
    dtype, workers = parse_dtype(dtype), _check_workers(workers)
    ck = open_megatron(src)
    with ck.source:
        fmt = _check_format(fmt or ck.fmt)
        layout = Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, first_stage_layers=first_stage_layers,
                        last_stage_layers=last_stage_layers, embedding_in_split=embedding_in_split,
                        loss_in_split=loss_in_split)
        validate_layout(ck.shape, layout)
        dst = ModelMap(ck.shape, padded_vocab(ck.shape.vocab_size, tp, VOCAB_DIVISOR))
        supply = through_hf(dst, ck.map, ck.supply)
        with atomic_output_dir(out_dir, overwrite) as tmp:
            file_jobs, finish, total = _megatron_jobs(
                tmp, dst, layout, supply, ck.source, fmt=fmt, dtype=dtype, workers=workers,
                grouped_gemm=ck.grouped_gemm if grouped_gemm is None else grouped_gemm)
            _write(file_jobs, finish, ck.source, total, progress, workers)
            if ck.side_dir is not None:
                shutil.copytree(ck.side_dir, tmp / "hf")
            else:
                _save_side_files(None, tmp / "hf", hf_config_dict(ck.shape))
    return Path(out_dir)
