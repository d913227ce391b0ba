"""hf_to_megatron, megatron_to_hf, megatron_to_megatron: plan the copies, then stream them.

Each function validates everything first (architecture, layout rules, every source tensor
present with the right shape, output folder free), then writes into a temporary folder
that is renamed into place at the end (toolkit.atomic): an error or interruption leaves
no output behind.
"""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from toolkit.atomic import atomic_output_dir, check_output_dir
from toolkit.models import hf_config_dict, read_hf_config, shape_from_hf
from toolkit.plan.layout import padded_vocab

from .errors import CheckpointError, ConversionSetupError
from .families import check_supported, with_mtp
from .formats import hf, torch_dist, torch_legacy
from .fp8 import dequantized
from .formats.megatron import open_megatron
from .layout import Layout, validate_layout
from .mapping import ModelMap, through_hf, to_ranks
from .megatron_args import VOCAB_DIVISOR, megatron_args
from .regions import compose, whole
from .stream import Meter, Progress, Target, check_sources, target_dtype

FORMATS = ("torch", "torch_dist")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
IGNORED_HF = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry; recomputed by every model


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConversionSetupError(f"unknown dtype '{dtype}'; use bf16, fp16 or fp32")
    return DTYPES[dtype]


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ConversionSetupError(f"unknown format '{fmt}'; use {' or '.join(FORMATS)}")
    return fmt


def _check_hf_extras(names, mm: ModelMap) -> None:
    """An HF tensor the table does not place would be silently dropped: refuse."""
    for name in names:
        tied_head = name == "lm_head.weight" and mm.shape.tie_embeddings
        if name not in mm.hf_shapes and not tied_head and not name.endswith(IGNORED_HF):
            raise CheckpointError(f"unexpected tensor '{name}' in the HF checkpoint: {mm.shape.architecture} "
                                  "as converted has no place for it")


def _check_aliases(mm: ModelMap, reader) -> None:
    """An HF alias (a copy megatron keeps once, e.g. an MTP module's embed_tokens) must equal
    its original, else dropping it would change the model: compared row block by row block."""
    for alias, of in mm.aliases.items():
        rows, step = mm.hf_shapes[of][0], 4096
        spans = [(r, min(rows, r + step)) for r in range(0, rows, step)]
        if any(not torch.equal(reader.rows(alias, a, b).clone(), reader.rows(of, a, b)) for a, b in spans):
            raise CheckpointError(f"'{alias}' differs from '{of}', which megatron-core shares with it; the "
                                  "checkpoint cannot be converted without changing the model")


def _targets(mm: ModelMap, pairs, source, dtype: torch.dtype | None) -> list[Target]:
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
            piece = torch_dist.Piece(c.src, c.src_row, c.src_col, (c.rows,) if nd == 1 else (c.rows, c.cols))
            copies = compose([whole(c.src, piece, c.rows, c.cols, src_row=c.src_row, src_col=c.src_col)], supply)
            out.append(Target(piece, piece.shape, target_dtype(copies, source, mm.dtype_for(c.src, dtype), c.src),
                              tuple(copies)))
    return out


def _write_megatron(out: Path, mm: ModelMap, layout: Layout, supply: dict, source, *, fmt: str,
                    dtype: torch.dtype | None, grouped_gemm: bool, progress: Progress | None) -> None:
    if fmt == "torch":
        targets = _targets(mm, to_ranks(mm, layout, supply, grouped_gemm), source, dtype)
    else:
        targets = _pieces(mm, layout, supply, source, dtype, grouped_gemm)
    main = Counter(t.dtype for t in targets).most_common(1)[0][0]
    args = megatron_args(mm.shape, layout, dtype=main, fmt=fmt, grouped_gemm=grouped_gemm)
    meter = Meter(sum(t.nbytes for t in targets), progress)
    if fmt == "torch":
        torch_legacy.write_checkpoint(out, targets, args, layout, source, meter)
    else:
        sizes = {"layer": mm.shape.num_layers, "expert": mm.shape.moe.num_experts if mm.shape.moe else 0}
        torch_dist.write_checkpoint(out, targets, mm.global_shapes, sizes, args, source, meter,
                                    stacked=not mm.shape.is_moe, norms=torch_dist.norm_keys(mm.shape))


def hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, *, tp: int, pp: int, vpp: int = 1, ep: int = 1,
                   etp: int | None = None, fmt: str = "torch", dtype: str | torch.dtype | None = None,
                   grouped_gemm: bool = False, overwrite: bool = False, progress: Progress | None = None,
                   first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                   embedding_in_split: bool = False, loss_in_split: bool = False) -> Path:
    """Convert an HF model folder into a Megatron checkpoint at this layout. Returns out_dir.
    FP8 block-scaled weights (DeepSeek-V3's) are dequantised on the way, to ``dtype`` or bf16
    (converters.fp8). ``first_stage_layers`` ... ``loss_in_split``: megatron's uneven pipeline
    split (converters.layout.Layout)."""
    check_output_dir(out_dir, overwrite)
    fmt, dtype = _check_format(fmt), parse_dtype(dtype)
    config, reader = hf.open_hf(hf_dir)
    try:
        check_supported((config.get("architectures") or ["(none)"])[0])
        config, reader = dequantized(config, reader, dtype)
        shape = with_mtp(shape_from_hf(config), reader.tensors, hf=True)
        layout = Layout(tp, pp, vpp, ep, etp, first_stage_layers, last_stage_layers, embedding_in_split, loss_in_split)
        validate_layout(shape, layout)
        mm = ModelMap(shape, padded_vocab(shape.vocab_size, tp, VOCAB_DIVISOR))
        check_sources(mm.hf_shapes, reader)
        _check_hf_extras(reader.tensors, mm)
        _check_aliases(mm, reader)
        with atomic_output_dir(out_dir, overwrite) as tmp:
            _write_megatron(tmp, mm, layout, mm.hf_to_global, reader, fmt=fmt, dtype=dtype,
                            grouped_gemm=grouped_gemm, progress=progress)
            _save_side_files(Path(hf_dir), tmp / "hf", config)
    finally:
        reader.close()
    return Path(out_dir)


def _save_side_files(src: Path | None, side: Path, config: dict[str, Any]) -> None:
    side.mkdir()
    (side / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf.copy_side_files(src, side)


def _hf_config_arg(hf_config: str | Path | dict | None) -> tuple[dict | None, Path | None]:
    if hf_config is None or isinstance(hf_config, dict):
        return hf_config, None
    p = Path(hf_config)
    return read_hf_config(p), p if p.is_dir() else p.parent


def megatron_to_hf(megatron_dir: str | Path, out_dir: str | Path, *, hf_config: str | Path | dict | None = None,
                   dtype: str | torch.dtype | None = None, overwrite: bool = False,
                   progress: Progress | None = None, max_shard_size: int | str = hf.MAX_SHARD) -> Path:
    """Export a Megatron checkpoint (legacy torch or torch_dist, any layout) to an HF folder."""
    check_output_dir(out_dir, overwrite)
    dtype = parse_dtype(dtype)
    cfg, cfg_dir = _hf_config_arg(hf_config)
    ck = open_megatron(megatron_dir, cfg)
    routes = {name: compose(copies, ck.supply) for name, copies in ck.map.global_to_hf.items()}
    targets = [Target(n, s, target_dtype(routes[n], ck.source, ck.map.dtype_for(n, dtype), n), tuple(routes[n]))
               for n, s in ck.map.hf_shapes.items()]
    main = Counter(t.dtype for t in targets).most_common(1)[0][0]
    with atomic_output_dir(out_dir, overwrite) as tmp:
        hf.write_weights(tmp, targets, ck.source, Meter(sum(t.nbytes for t in targets), progress), max_shard_size)
        hf.write_config(tmp, cfg or hf_config_dict(ck.shape), main)
        hf.copy_side_files(ck.side_dir or cfg_dir, tmp)
    return Path(out_dir)


def megatron_to_megatron(src: str | Path, out_dir: str | Path, *, tp: int, pp: int, vpp: int = 1, ep: int = 1,
                         etp: int | None = None, fmt: str | None = None, dtype: str | torch.dtype | None = None,
                         grouped_gemm: bool | None = None, overwrite: bool = False,
                         progress: Progress | None = None, first_stage_layers: int | None = None,
                         last_stage_layers: int | None = None, embedding_in_split: bool = False,
                         loss_in_split: bool = False) -> Path:
    """Reshard (tp/pp/vpp/ep/etp, even or uneven pipeline split) and/or change the format;
    values move file to file."""
    check_output_dir(out_dir, overwrite)
    dtype = parse_dtype(dtype)
    ck = open_megatron(src)
    fmt = _check_format(fmt or ck.fmt)
    layout = Layout(tp, pp, vpp, ep, etp, first_stage_layers, last_stage_layers, embedding_in_split, loss_in_split)
    validate_layout(ck.shape, layout)
    dst = ModelMap(ck.shape, padded_vocab(ck.shape.vocab_size, tp, VOCAB_DIVISOR))
    supply = through_hf(dst, ck.map, ck.supply)
    with atomic_output_dir(out_dir, overwrite) as tmp:
        _write_megatron(tmp, dst, layout, supply, ck.source, fmt=fmt, dtype=dtype,
                        grouped_gemm=ck.grouped_gemm if grouped_gemm is None else grouped_gemm, progress=progress)
        if ck.side_dir is not None:
            shutil.copytree(ck.side_dir, tmp / "hf")
        else:
            _save_side_files(None, tmp / "hf", hf_config_dict(ck.shape))
    return Path(out_dir)
