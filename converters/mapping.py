"""The whole model's mapping: HF tensors <-> global Megatron tensors <-> rank tensors.

``ModelMap`` is built from a ModelShape and the padded vocabulary; the routes
(hf -> megatron, megatron -> hf, megatron -> megatron) are compositions of its copy
lists, so every route moves each value once, straight from a source file to a
destination file.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from functools import cached_property

from toolkit.models import ModelShape
from toolkit.models.family import aliases_for, table_for
from toolkit.models.weights import PARTS, Entry, expand
from toolkit.parallel.layout import Layout
from toolkit.regions import Copy, by_dst, compose, invert, rename

from .dtypes import DType, dtype_of
from .sharding import RankTensor, rank_tensors


@dataclass(frozen=True)
class GlobalTensor:
    entry: Entry
    shape: tuple[int, ...]  # global Megatron shape (vocabulary padded)
    from_hf: tuple[Copy, ...]


@dataclass(frozen=True)
class ModelMap:
    shape: ModelShape
    padded_vocab: int

    @cached_property
    def tensors(self) -> list[GlobalTensor]:
        out = []
        for e in expand(self.shape, table_for(self.shape)):
            gshape = e.mapping.global_shape(self.shape, self.padded_vocab)
            out.append(GlobalTensor(e, gshape, tuple(e.mapping.to_global(self.shape, list(e.hf), e.name,
                                                                          self.padded_vocab))))
        return out

    @cached_property
    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor of the model, in order, with the shape it must have (aliases last)."""
        own = {n: s for t in self.tensors for n, s in zip(t.entry.hf, t.entry.mapping.hf_shapes(self.shape))}
        return {**own, **{alias: own[of] for alias, of in self.aliases.items()}}

    @cached_property
    def aliases(self) -> dict[str, str]:
        """HF tensors that are copies of others (alias -> original): megatron keeps one."""
        return aliases_for(self.shape)

    @cached_property
    def keep_dtypes(self) -> dict[str, DType]:
        """Global and HF names of the tensors that keep a dtype whatever --dtype says."""
        out = {}
        for t in self.tensors:
            if t.entry.mapping.keep_dtype is not None:
                out.update(dict.fromkeys((t.entry.name, *t.entry.hf), dtype_of(t.entry.mapping.keep_dtype)))
        return out

    def dtype_for(self, name: Hashable, dtype: DType | None) -> DType | None:
        """The dtype asked for (None: the source's), unless the tensor keeps its own."""
        return self.keep_dtypes.get(name, dtype) if dtype is not None else None

    @cached_property
    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.entry.name: t.shape for t in self.tensors}

    @cached_property
    def part_keys(self) -> dict[str, tuple[tuple[str, int, int], ...]]:
        """Global name -> (part name, first row, rows) of each part of a PARTS-split tensor, which
        megatron's torch_dist stores as one key per part (``<name>.<part>``: gated delta nets)."""
        out = {}
        for t in self.tensors:
            m = t.entry.mapping
            if m.split == PARTS:
                rows = m.parts(self.shape)
                starts = [sum(rows[:i]) for i in range(len(rows))]
                out[t.entry.name] = tuple(zip(m.part_names, starts, rows))
        return out

    @cached_property
    def hf_to_global(self) -> dict[Hashable, list[Copy]]:
        """Global name -> the copies that build it from HF tensors."""
        return by_dst(c for t in self.tensors for c in t.from_hf)

    @cached_property
    def global_to_hf(self) -> dict[Hashable, list[Copy]]:
        """HF name -> the copies that build it from global tensors (the inverse; an alias is
        built like the tensor it copies)."""
        out = by_dst(invert(c for t in self.tensors for c in t.from_hf))
        out.update({alias: rename(out[of], dst=lambda _, a=alias: a) for alias, of in self.aliases.items()})
        return out

    def rank_tensors(self, layout: Layout, grouped_gemm: bool = False, legacy: bool = True) -> list[RankTensor]:
        """Every rank tensor of ``layout``; ``legacy`` places them in Megatron-LM's rank files."""
        return [rt for t in self.tensors
                for rt in rank_tensors(self.shape, layout, t.entry, t.shape, grouped_gemm, legacy)]


def to_ranks(dst: ModelMap, layout: Layout, supply: dict[Hashable, list[Copy]],
             grouped_gemm: bool = False) -> list[tuple[RankTensor, list[Copy]]]:
    """Each rank tensor of ``layout`` with copies from whatever ``supply`` builds the global
    tensors of ``dst`` from (HF tensors, or another layout's rank tensors)."""
    return [(rt, compose(rt.copies, supply)) for rt in dst.rank_tensors(layout, grouped_gemm)]


def ranks_to_global(src: ModelMap, layout: Layout, grouped_gemm: bool = False) -> dict[Hashable, list[Copy]]:
    """Global name -> copies from the rank tensors of ``layout`` (first holder wins)."""
    return by_dst(invert(c for rt in src.rank_tensors(layout, grouped_gemm) for c in rt.copies))


def through_hf(dst: ModelMap, src: ModelMap, src_supply: dict[Hashable, list[Copy]]) -> dict[Hashable, list[Copy]]:
    """Global tensors of ``dst`` built from ``src``'s sources, routed through the HF names
    (which is how two layouts with different vocabulary padding agree on the rows)."""
    hf = {name: compose(copies, src_supply) for name, copies in src.global_to_hf.items()}
    return {name: compose(copies, hf) for name, copies in dst.hf_to_global.items()}
