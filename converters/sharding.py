"""Global Megatron tensors <-> the tensors each rank holds (a Megatron layout).

A rank tensor is named by ``Local(tp, pp, ep, vp, name)``: the legacy folder
``mp_rank_{tp}[_{pp}][_{ep}]``, the virtual chunk (``model`` / ``model{vp}``) and the
state-dict name, in which layer numbers count from 0 inside the chunk and expert numbers
from 0 inside the expert-parallel rank (SequentialMLP ``local_experts.E`` or grouped GEMM
``experts.linear_fcN.weightE``). Dense tensors are repeated on every ep rank.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

from toolkit.models import ModelShape
from toolkit.models.weights import COLUMN, GATED, PARTS, REPLICATED, ROW, Entry
from toolkit.parallel.layout import Layout
from toolkit.regions import Copy, as_2d, whole

from .errors import ConversionSetupError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
TIED_OUTPUT = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"


class Local(NamedTuple):
    tp: int
    pp: int
    ep: int
    vp: int
    name: str


@dataclass(frozen=True)
class RankTensor:
    key: Local
    shape: tuple[int, ...]
    copies: list[Copy]  # global Megatron tensor -> this rank tensor


def split(style: str, rows: int, cols: int, size: int, rank: int, src, dst,
          parts: tuple[int, ...] = ()) -> tuple[tuple[int, int], list[Copy]]:
    """Rank ``rank`` of ``size``: its (rows, cols) and where they come from in the global tensor
    (``parts``: the rows of each part of a PARTS-split tensor)."""
    if style == PARTS:
        out, start, row = [], 0, 0
        for n in parts:
            k = n // size
            out.append(whole(src, dst, k, cols, src_row=start + rank * k, dst_row=row))
            start, row = start + n, row + k
        return (row, cols), out
    if style == REPLICATED or (size == 1 and style != GATED):  # gated: [gate; up] stay two pieces
        return (rows, cols), [whole(src, dst, rows, cols)]
    if style == COLUMN:
        n = rows // size
        return (n, cols), [whole(src, dst, n, cols, src_row=rank * n)]
    if style == ROW:
        m = cols // size
        return (rows, m), [whole(src, dst, rows, m, src_col=rank * m)]
    if style == GATED:
        f = rows // 2 // size
        return (2 * f, cols), [whole(src, dst, f, cols, src_row=rank * f),
                               whole(src, dst, f, cols, src_row=rows // 2 + rank * f, dst_row=f)]
    raise ValueError(style)


def _rank_shape(global_shape: tuple[int, ...], rows: int, cols: int) -> tuple[int, ...]:
    """A rank tensor's shape: its (rows, cols) of the 2-D view in the global tensor's rank (the
    trailing dims of a 3-D tensor, e.g. a conv1d weight [channels, 1, kernel], split only by rows)."""
    if len(global_shape) == 1:
        return (rows,)
    if len(global_shape) > 2 and cols == as_2d(global_shape)[1]:
        return (rows, *global_shape[1:])
    return (rows, cols)


def local_name(shape: ModelShape, layout: Layout, name: str, grouped_gemm: bool) -> tuple[int, int, str]:
    """(pp_rank, vp, state-dict name inside that chunk) of a global name. Decoder layers go
    where megatron's pipeline split puts them; the embedding to the first chunk; the rest
    (final norm, MTP modules, output layer) to the last."""
    m = _LAYER.match(name)
    if m is None:
        first = name.startswith("embedding.")
        pp_rank, vp = (0, 0) if first else (layout.pp - 1, layout.vpp - 1)
    else:
        pp_rank, vp, index = layout.place_layer(shape.num_layers, int(m.group(1)))
        name = f"decoder.layers.{index}." + name[m.end():]
    e = _EXPERT.search(name)
    if e is not None:
        _, local = layout.place_expert(shape.moe.num_experts, int(e.group(1)))
        tail = f".mlp.experts.{e.group(2)}.{e.group(3)}{local}" if grouped_gemm else \
            f".mlp.experts.local_experts.{local}.{e.group(2)}.{e.group(3)}"
        name = name[:e.start()] + tail
    return pp_rank, vp, name


def _copies_on_last_stage(shape: ModelShape, layout: Layout, name: str) -> list[tuple[int, int, str]]:
    """Where the last pipeline stage keeps its own copy of the embedding when pp > 1: as the
    tied output layer, and as the embedding of its MTP modules (GPTModel builds one there)."""
    if name != EMBEDDING or layout.pp == 1:
        return []
    last = (layout.pp - 1, layout.vpp - 1)
    return ([(*last, TIED_OUTPUT)] if shape.tie_embeddings else []) + ([(*last, EMBEDDING)] if shape.mtp_layers else [])


def rank_files(layout: Layout) -> list[tuple[int, int]]:
    """(tp rank, ep rank) of the legacy rank files of one pipeline stage. Megatron-LM saves
    from the first expert-data-parallel group, whose rank i has expert-tp rank i % etp,
    ep rank i // etp and tp rank i % tp (megatron's rank order is tp fastest, then ep);
    this is every (tp, ep) pair when etp == tp. A file per tp rank, none written twice,
    needs etp <= tp and tp dividing etp * ep."""
    tp, etp, ep = layout.tp, layout.expert_tp, layout.ep
    if etp != tp and (etp > tp or (etp * ep) % tp):
        raise ConversionSetupError(f"the legacy torch format cannot hold etp={etp} with tp={tp} ep={ep} (it needs "
                                   "etp <= tp and tp dividing etp*ep); use --format torch_dist")
    return sorted({(i % tp, i // etp) for i in range(etp * ep)})


def _holders(shape: ModelShape, layout: Layout, entry: Entry, legacy: bool) -> list[tuple[int, int, int, int]]:
    """(tp rank, ep rank) of each holder of this tensor, with its rank and size in the
    split: dense tensors split over tp (in every file of that tp rank), an expert's over
    etp on the ep rank that owns it. Without files (torch_dist) the expert-tp rank is used."""
    if entry.expert is None:
        pairs = rank_files(layout) if legacy else [(t, 0) for t in range(layout.tp)]
        return [(t, e, t, layout.tp) for t, e in pairs]
    owner, _ = layout.place_expert(shape.moe.num_experts, entry.expert)
    etp = layout.expert_tp
    if legacy:
        rank_files(layout)  # refuses layouts the legacy format cannot hold
    return [((owner * etp + k) % layout.tp if legacy else k, owner, k, etp) for k in range(etp)]


def rank_tensors(shape: ModelShape, layout: Layout, entry: Entry, global_shape: tuple[int, ...],
                 grouped_gemm: bool = False, legacy: bool = True) -> list[RankTensor]:
    """The rank tensors that hold global tensor ``entry`` (plus the last stage's copies of
    the embedding when pp > 1)."""
    rows, cols = as_2d(global_shape)
    places = [local_name(shape, layout, entry.name, grouped_gemm), *_copies_on_last_stage(shape, layout, entry.name)]
    out = []
    for pp_rank, vp, lname in places:
        for tp_rank, ep_rank, rank, size in _holders(shape, layout, entry, legacy):
            key = Local(tp_rank, pp_rank, ep_rank, vp, lname)
            parts = entry.mapping.parts(shape) if entry.mapping.split == PARTS else ()
            (r, c), copies = split(entry.mapping.split, rows, cols, size, rank, entry.name, key, parts)
            out.append(RankTensor(key, _rank_shape(global_shape, r, c), copies))
    return out
