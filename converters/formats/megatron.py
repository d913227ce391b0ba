"""Opening an existing Megatron checkpoint (either format): its model, layout and tensors.

Everything is read from the checkpoint itself: the layout from the rank folders (checked
against ``args``), the model from ``args`` (or ``--hf-config`` when there are none), the
padded vocabulary from the embedding. Every tensor the model needs must be there with the
right shape, and nothing else may be (an unknown tensor would be silently dropped).
"""
from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from toolkit.models import ModelShape

from ..errors import CheckpointError, LayoutMismatchError, MissingTensorError
from ..families import check_supported, with_mtp
from ..layout import Layout
from ..mapping import ModelMap, ranks_to_global
from ..megatron_args import layout_from_args, shape_from_args
from ..regions import as_2d, by_dst, whole
from ..sharding import Local, rank_files
from ..stream import as_bytes, check_sources, label
from . import torch_dist
from .torch_legacy import chunk_models, iteration_dir, load_rank_file, rank_dir, rank_folders

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
    source: Any  # stream.Source over Local names (torch) or global names (torch_dist)
    map: ModelMap
    supply: dict = field(repr=False)  # global name -> copies from source tensors

    @property
    def side_dir(self) -> Path | None:
        """HF config/tokenizer files saved next to the checkpoint by hf_to_megatron."""
        d = self.root / "hf"
        return d if d.is_dir() else None


class LegacySource:
    """Rank tensors of a legacy checkpoint, each rank file memory-mapped when first needed."""

    def __init__(self, files: dict[tuple[int, int, int], Path]):
        self.files = files
        self._models: dict[tuple[int, int, int], list[dict]] = {}

    def models(self, rank: tuple[int, int, int]) -> list[dict]:
        if rank not in self._models:
            path = self.files[rank]
            self._models[rank] = chunk_models(load_rank_file(path), path)
        return self._models[rank]

    def tensor(self, name: Local):
        models = self.models((name.tp, name.pp, name.ep)) if (name.tp, name.pp, name.ep) in self.files else []
        t = models[name.vp].get(name.name) if name.vp < len(models) else None
        if t is None:
            raise MissingTensorError(f"missing tensor '{label(name)}'")
        return t

    def meta(self, name):
        t = self.tensor(name)
        return tuple(t.shape), t.dtype

    def rows(self, name, start, stop):
        t = self.tensor(name)
        return t.reshape(as_2d(tuple(t.shape)))[start:stop]

    def window(self, name, start, stop):
        """The rows' bytes, a view of the memory-mapped rank file (valid while referenced)."""
        return as_bytes(self.rows(name, start, stop))

    def names(self):
        for rank in self.files:
            for vp, model in enumerate(self.models(rank)):
                for n, v in model.items():
                    if not n.endswith("._extra_state"):
                        yield Local(*rank, vp, n)


def _rank_layout(parts: list[tuple[str, ...]], args: Namespace | None, source: LegacySource) -> tuple[int, int, int]:
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
        first = min(source.files)
        is_pp = not any(FINAL_NORM in m for m in source.models(first))
    return (tp, last, 1) if is_pp else (tp, 1, last)


def _open_legacy(root: Path, d: Path, hf_config: dict | None) -> MegatronCheckpoint:
    folders = rank_folders(d)
    parts = list(folders)
    first = load_rank_file(folders[parts[0]])
    args = first.get("args") if isinstance(first.get("args"), Namespace) else None
    vpp = len(chunk_models(first, folders[parts[0]]))
    provisional = LegacySource({_rank_key(p, len(p) == 2): f for p, f in folders.items()})
    tp, pp, ep = _rank_layout(parts, args, provisional)
    files = {_rank_key(p, pp > 1): f for p, f in folders.items()}
    layout = _check_ranks(files, args, Layout(tp=tp, pp=pp, vpp=vpp, ep=ep))
    shape = shape_from_args(args, hf_config)
    check_supported(shape.architecture)
    source = LegacySource(files)
    if args is None:
        shape = with_mtp(shape, source.names(), hf=False)
        layout = _split_from_files(shape, layout, source)
    emb = source.tensor(Local(0, 0, 0, 0, EMBEDDING))
    grouped = any(".mlp.experts.linear_fc" in n for rank in files for m in source.models(rank) for n in m)
    mm = ModelMap(shape, emb.shape[0] * layout.tp)
    expected = {rt.key: rt.shape for rt in mm.rank_tensors(layout, grouped)}
    _check_complete(expected, source)
    return MegatronCheckpoint(root, "torch", args, shape, layout, grouped, source, mm,
                              ranks_to_global(mm, layout, grouped))


def _split_from_files(shape: ModelShape, layout: Layout, source: LegacySource) -> Layout:
    """Without args: megatron's uneven split (first / last stage layers) when the stages of
    tp rank 0 hold other layer counts than an even split gives."""
    if layout.pp == 1:
        return layout
    counts = [[len({n.split(".")[2] for n in m if n.startswith("decoder.layers.")}) for m in source.models((0, p, 0))]
              for p in range(layout.pp)]
    even = layout.split(shape.num_layers)
    if not even.problems() and all(c == even.layers(p, v) for p, cs in enumerate(counts) for v, c in enumerate(cs)):
        return layout
    uneven = replace(layout, first_stage_layers=sum(counts[0]), last_stage_layers=sum(counts[-1]))
    split = uneven.split(shape.num_layers)
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


def _check_ranks(files: dict, args: Namespace | None, found: Layout) -> Layout:
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
        layout = Layout(found.tp, found.pp, found.vpp, found.ep, etp if etp != found.tp else None)
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


def _check_complete(expected: dict, source) -> None:
    check_sources(expected, source)
    unknown = [n for n in source.names() if n not in expected]
    if unknown:
        raise CheckpointError(f"unexpected tensor '{label(unknown[0])}' in the checkpoint"
                              + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
                              + ": it has no place in the model described by the args")


def _open_dist(root: Path, d: Path, hf_config: dict | None) -> MegatronCheckpoint:
    common = torch_dist.load_common(d)
    args = common.get("args") if isinstance(common.get("args"), Namespace) else None
    shape = shape_from_args(args, hf_config)
    check_supported(shape.architecture)
    if args is None:
        shape = with_mtp(shape, torch_dist.DistReader(d).tensors, hf=False)
    reader = torch_dist.DistReader(d, torch_dist.norm_keys(shape), torch_dist.TE_MLA_KEYS if shape.mla else None)
    mm = ModelMap(shape, reader.meta(EMBEDDING)[0][0])
    check_sources(mm.global_shapes, reader)
    known = {reader.key(n)[0] for n in mm.global_shapes}
    unknown = sorted(set(reader.tensors) - known)
    if unknown:
        raise CheckpointError(f"unexpected tensor '{unknown[0]}' in the torch_dist checkpoint: it has no place "
                              f"in {shape.architecture} as described")
    supply = by_dst(whole(n, n, *as_2d(s)) for n, s in mm.global_shapes.items())
    layout = layout_from_args(args) if args is not None else Layout()
    return MegatronCheckpoint(root, "torch_dist", args, shape, layout, False, reader, mm, supply)


def open_megatron(path: str | Path, hf_config: dict[str, Any] | None = None) -> MegatronCheckpoint:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"Megatron checkpoint folder '{root}' does not exist")
    d = iteration_dir(root)
    if rank_folders(d):
        return _open_legacy(root, d, hf_config)
    if torch_dist.is_torch_dist(d):
        return _open_dist(root, d, hf_config)
    raise CheckpointError(f"'{root}' is not a Megatron checkpoint (no mp_rank_* folders, no torch_dist metadata.json)")
