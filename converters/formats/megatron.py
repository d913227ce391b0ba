"""Opening an existing Megatron checkpoint (either format): its model, layout and tensors.

Everything is read from the checkpoint itself: the layout from the rank folders (checked
against ``args``), the model from ``args`` or, where they do not carry the HF config, from
the ``hf/config.json`` side folder (the training runtime's and hf_to_megatron's
convention) or ``--hf-config``; the padded vocabulary from the embedding. Every tensor the
model needs must be there with the right shape, and nothing else may be (an unknown
tensor would be silently dropped). Only pickles, zip directories and DCP metadata are
read here; tensors stay on disk until their bytes are copied.
"""
from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from toolkit.models import ModelShape, read_hf_config
from toolkit.models.family import check_supported, with_mtp
from toolkit.parallel.layout import Layout
from toolkit.regions import as_2d

from ..errors import CheckpointError, CorruptFileError, LayoutMismatchError
from ..files import FileTensors
from ..mapping import ModelMap, ranks_to_global
from ..megatron_args import layout_from_args, shape_from_args
from ..sharding import Local, rank_files
from ..staged import check_finished
from ..stream import check_sources, label
from . import torch_dist
from .torch_legacy import iteration_dir, rank_dir, rank_folders, read_rank_file

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"


@dataclass
class MegatronCheckpoint:
    root: Path
    fmt: str  # "torch" | "torch_dist"
    args: Namespace | None
    shape: ModelShape
    layout: Layout
    grouped_gemm: bool
    source: Any  # stream.Source over Local names (torch) or DistChunk names (torch_dist)
    map: ModelMap
    supply: dict = field(repr=False)  # global name -> copies from source tensors
    rank_files: dict = field(default_factory=dict, repr=False)  # legacy: (tp, pp, ep) -> model_optim_rng.pt

    @property
    def side_dir(self) -> Path | None:
        """HF config/tokenizer files saved next to the checkpoint by hf_to_megatron."""
        d = self.root / "hf"
        return d if d.is_dir() else None


def side_config(root: Path) -> dict | None:
    """The ``hf/config.json`` saved beside the checkpoint, if any."""
    p = root / "hf" / "config.json"
    return read_hf_config(p) if p.is_file() else None


def describe(root: Path, args: Namespace | None, hf_config: dict | None) -> ModelShape:
    """The model: ``hf_config`` when given, else the args' own HF config, else the side
    folder's config.json, else the args' Megatron-LM flags."""
    cfg = hf_config or (getattr(args, "hf_config", None) if args is not None else None) or side_config(root)
    shape = shape_from_args(args, cfg)
    check_supported(shape.architecture)
    return shape


def _rank_layout(parts: list[tuple[str, ...]], args: Namespace | None,
                 chunks: dict[tuple[str, ...], list[dict]]) -> tuple[int, int, int]:
    """(tp, pp, ep) from folder names. With one suffix it is pp or ep: args say which; without
    args, the first of several pipeline stages holds no final norm while ep ranks all do (the
    embedding would not tell: a last stage with MTP modules keeps a copy of it)."""
    n = {len(p) for p in parts}
    if len(n) != 1:
        raise LayoutMismatchError("rank folders mix naming schemes: " + ", ".join("mp_rank_" + "_".join(p) for p in parts))
    tp, ints = 1 + max(int(p[0]) for p in parts), [tuple(map(int, p)) for p in parts]
    if n == {1}:
        return tp, 1, 1
    last = 1 + max(p[-1] for p in ints)
    if n == {3}:
        return tp, 1 + max(p[1] for p in ints), last
    if args is not None:
        is_pp = getattr(args, "pipeline_model_parallel_size", 1) > 1
    else:
        is_pp = not any(FINAL_NORM in c for c in chunks[min(parts)])
    return (tp, last, 1) if is_pp else (tp, 1, last)


def _open_legacy(root: Path, d: Path, hf_config: dict | None) -> MegatronCheckpoint:
    folders = rank_folders(d)
    parts = list(folders)
    read = {p: read_rank_file(f) for p, f in folders.items()}
    args = read[parts[0]][0]
    args = args if isinstance(args, Namespace) else None
    chunks = {p: c for p, (_, c) in read.items()}
    tp, pp, ep = _rank_layout(parts, args, chunks)
    keys = {p: _rank_key(p, pp > 1) for p in parts}
    layout = _check_ranks(set(keys.values()), args, Layout(tp=tp, pp=pp, vpp=len(chunks[parts[0]]), ep=ep))
    shape = describe(root, args, hf_config)
    source = FileTensors({Local(*keys[p], vp, n): info for p in parts for vp, infos in enumerate(chunks[p])
                          for n, info in infos.items()}, str(root))
    if args is None:
        shape = with_mtp(shape, source.tensors, hf=False)
        layout = _split_from_files(shape, layout, source)
    emb, _ = source.meta(Local(0, 0, 0, 0, EMBEDDING))
    grouped = any(".mlp.experts.linear_fc" in n.name for n in source.tensors)
    mm = ModelMap(shape, emb[0] * layout.tp)
    expected = {rt.key: rt.shape for rt in mm.rank_tensors(layout, grouped)}
    _check_complete(expected, source)
    return MegatronCheckpoint(root, "torch", args, shape, layout, grouped, source, mm,
                              ranks_to_global(mm, layout, grouped), {keys[p]: f for p, f in folders.items()})


def _split_from_files(shape: ModelShape, layout: Layout, source: FileTensors) -> Layout:
    """Without args: megatron's uneven split (first / last stage layers) when the stages of
    tp rank 0 hold other layer counts than an even split gives."""
    if layout.pp == 1:
        return layout
    layers: dict[tuple[int, int], set[str]] = {(p, v): set() for p in range(layout.pp) for v in range(layout.vpp)}
    for n in source.tensors:
        if n.tp == 0 and n.ep == 0 and n.name.startswith("decoder.layers."):
            layers[(n.pp, n.vp)].add(n.name.split(".")[2])
    counts = [[len(layers[(p, v)]) for v in range(layout.vpp)] for p in range(layout.pp)]
    even = layout.pipeline(shape.num_layers)
    if not even.problems() and all(c == even.layers(p, v) for p, cs in enumerate(counts) for v, c in enumerate(cs)):
        return layout
    uneven = replace(layout, first_stage_layers=sum(counts[0]), last_stage_layers=sum(counts[-1]))
    split = uneven.pipeline(shape.num_layers)
    if split.problems() or any(c != split.layers(p, v) for p, cs in enumerate(counts) for v, c in enumerate(cs)):
        raise LayoutMismatchError(f"the pipeline stages hold {counts} decoder layers per chunk, which no split "
                                  f"megatron-core makes of {shape.num_layers} layers gives; the checkpoint has no "
                                  "args to say how it was split")
    return uneven


def _rank_key(parts: tuple[str, ...], second_is_pp: bool) -> tuple[int, int, int]:
    ints = [int(x) for x in parts] + [0] * (3 - len(parts))
    if len(parts) == 2 and not second_is_pp:
        return ints[0], 0, ints[1]
    return ints[0], ints[1], ints[2]


def _check_ranks(files: set, args: Namespace | None, found: Layout) -> Layout:
    """The layout, with every rank folder present and agreeing with the args. Without
    args, a MoE checkpoint with fewer folders than tp * ep per stage was written with an
    expert-tensor-parallel size etp = folders / ep (see sharding.rank_files)."""
    layout = found
    if args is not None:
        a = layout_from_args(args)
        layout = replace(a, vpp=found.vpp)
        if a.vpp != found.vpp:
            raise LayoutMismatchError(f"args say virtual_pipeline_model_parallel_size={a.vpp} but the rank "
                                      f"files hold {found.vpp} model chunk(s)")
    elif found.ep > 1 and len(files) < found.tp * found.pp * found.ep:
        etp = len(files) // (found.pp * found.ep)
        layout = Layout(tp=found.tp, pp=found.pp, vpp=found.vpp, ep=found.ep, etp=etp if etp != found.tp else None)
    want = {(t, p, e) for t, e in rank_files(layout) for p in range(layout.pp)}
    extra = sorted(set(files) - want)
    if extra:
        raise LayoutMismatchError(
            f"args say {layout.describe()} but the checkpoint has rank folder(s) "
            + ", ".join(rank_dir(*r, max(layout.pp, found.pp), max(layout.ep, found.ep)) for r in extra))
    missing = sorted(want - set(files))
    if missing:
        raise CheckpointError(f"legacy checkpoint is missing rank folder(s) for {layout.describe()}: "
                              + ", ".join(rank_dir(*r, layout.pp, layout.ep) for r in missing))
    return layout


def _check_complete(expected: dict, source: FileTensors) -> None:
    check_sources(expected, source.meta)
    unknown = [n for n in source.tensors if n not in expected]
    if unknown:
        raise CheckpointError(f"unexpected tensor '{label(unknown[0])}' in the checkpoint"
                              + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
                              + ": it has no place in the model described by the args")


def _open_dist(root: Path, d: Path, hf_config: dict | None) -> MegatronCheckpoint:
    common = torch_dist.load_common(d, plain=True)
    args = common.get("args") if isinstance(common.get("args"), Namespace) else None
    shape = describe(root, args, hf_config)
    reader = torch_dist.DistReader(d)
    if args is None:
        shape = with_mtp(shape, reader.keys, hf=False)
    reader.names_for(shape)
    mm = ModelMap(shape, reader.global_meta(EMBEDDING)[0][0])
    reader.names_for(shape, mm.part_keys)
    check_sources(mm.global_shapes, reader.global_meta)
    known = {k for n in mm.global_shapes for k, _ in reader.stored_keys(n)}
    unknown = sorted(set(reader.keys) - known)
    if unknown:
        raise CheckpointError(f"unexpected tensor '{unknown[0]}' in the torch_dist checkpoint: it has no place "
                              f"in {shape.architecture} as described")
    supply = {n: reader.supply(n) for n in mm.global_shapes}
    for n, s in mm.global_shapes.items():
        rows, cols = as_2d(s)
        if sum(c.area for c in supply[n]) != rows * cols:
            raise CorruptFileError(f"torch_dist checkpoint '{d}' does not hold all of '{n}' (its chunks cover "
                                   f"{sum(c.area for c in supply[n])} of {rows * cols} values)")
    layout = layout_from_args(args) if args is not None else Layout()
    return MegatronCheckpoint(root, "torch_dist", args, shape, layout, False, reader, mm, supply)


def open_megatron(path: str | Path, hf_config: dict[str, Any] | None = None) -> MegatronCheckpoint:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"Megatron checkpoint folder '{root}' does not exist")
    check_finished(root)
    d = iteration_dir(root)
    if rank_folders(d):
        return _open_legacy(root, d, hf_config)
    if torch_dist.is_torch_dist(d):
        return _open_dist(root, d, hf_config)
    raise CheckpointError(f"'{root}' is not a Megatron checkpoint (no mp_rank_* folders, no torch_dist metadata.json)")
