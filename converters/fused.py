"""Typed mappings between HF tensors and one global (unsplit) Megatron tensor.

A mapping knows (1) the shapes the HF tensors must have, (2) how they are laid out in the
global Megatron tensor (``to_global``: a list of row copies), and (3) how that tensor is
split over tensor-parallel ranks (``split``). Layouts (../shared/REFERENCE.md, checked
against megatron-core 0.16.1 by logits in the tests):
  QKV    [G, (H/G)*d + d + d, h]: per query group its H/G query heads, its key, its value;
         a tp rank holds a contiguous 1/tp of the groups (needs G % tp == 0).
  Gated  linear_fc1 = [gate; up]; tp rank i holds [gate chunk i; up chunk i].
  Vocab  [padded_vocab, h]: rows past the HF vocabulary are zero; column-split.
  Row    linear_proj / linear_fc2: split along the input (column) dimension.
  Column one HF tensor as it is, split along its rows (output dimension). Multi-latent
         attention (DeepSeek) needs nothing more: HF and megatron-core lay out q_b_proj /
         linear_q_up_proj as [heads, nope + rope] rows and kv_b_proj / linear_kv_up_proj as
         [heads, k_nope + v] rows, so a tp rank's contiguous 1/tp of the rows is its
         heads; the latent down-projections (local spec: column-parallel, all-gathered
         right after) split their [q_lora] / [kv_lora + rope] rows the same way; rope
         dims need no permutation (megatron de-interleaves them itself with
         multi_latent_attention, as transformers' interleaved rope does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from toolkit.models import ModelShape

from .dtypes import DType
from .regions import Copy, as_2d, whole

# Split styles (how layer B divides a global tensor over tp or expert-tp ranks).
REPLICATED, COLUMN, ROW, GATED = "replicated", "column", "row", "gated"
DENSE, MOE, ALL = "dense", "moe", "all"  # which decoder layers a layer entry applies to


def _mla_dims(shape: ModelShape) -> dict[str, int]:
    a = shape.mla
    if a is None:
        return {}
    heads = shape.num_attention_heads
    return {"q_lora": a.q_lora_rank or 0, "kv_lora": a.kv_lora_rank,
            "kv_lora_rope": a.kv_lora_rank + a.qk_rope_head_dim,
            "q_heads": heads * (a.qk_nope_head_dim + a.qk_rope_head_dim),
            "kv_heads": heads * (a.qk_nope_head_dim + a.v_head_dim), "v_heads": heads * a.v_head_dim}


def dim(shape: ModelShape, name: str | int) -> int:
    """A named model dimension (or a literal)."""
    if isinstance(name, int):
        return name
    m = shape.moe
    return {
        "hidden": shape.hidden_size, "head_dim": shape.head_dim, "vocab": shape.vocab_size,
        "q": shape.num_attention_heads * shape.head_dim, "kv": shape.num_query_groups * shape.head_dim,
        "ffn": shape.ffn_hidden_size, "experts": m.num_experts if m else 0,
        "expert_ffn": m.ffn_hidden_size if m else 0, "shared_ffn": m.shared_ffn_hidden_size if m else 0,
        "hidden2": 2 * shape.hidden_size, **_mla_dims(shape),
    }[name]


@dataclass(frozen=True)
class Mapping:
    """One global Megatron tensor from ``hf`` tensors (name patterns, ``{}`` = layer, expert)."""

    hf: tuple[str, ...] | str
    scope: str = ALL
    # a dtype this tensor keeps whatever --dtype says (megatron and transformers keep the
    # aux-loss-free expert bias in fp32); None: it follows --dtype like the rest
    keep_dtype: DType | None = None
    split: ClassVar[str] = REPLICATED

    def __post_init__(self):
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))

    def hf_shapes(self, shape: ModelShape) -> list[tuple[int, ...]]:
        """The shapes of the HF tensors this mapping reads, in ``self.hf`` order (each
        subclass knows its own; the base class has none to give)."""
        raise NotImplementedError(f"{type(self).__name__} must define hf_shapes")

    def global_shape(self, shape: ModelShape, padded_vocab: int) -> tuple[int, ...]:
        """Rows of the HF tensors stacked (what every fused mapping here produces)."""
        shapes = self.hf_shapes(shape)
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def to_global(self, shape: ModelShape, names: list[str], dst: str, padded_vocab: int) -> list[Copy]:
        """HF tensors placed one after the other along the rows (gate; up) by default."""
        out, row = [], 0
        for name, s in zip(names, self.hf_shapes(shape)):
            rows, cols = as_2d(s)
            out.append(whole(name, dst, rows, cols, dst_row=row))
            row += rows
        return out


@dataclass(frozen=True)
class Replicated(Mapping):
    """Norm weights, router, shared-expert gate: the same tensor on every tp rank."""

    dims: tuple[str | int, ...] = ("hidden",)

    def hf_shapes(self, shape):
        return [tuple(dim(shape, d) for d in self.dims)]


@dataclass(frozen=True)
class Row(Mapping):
    """linear_proj / linear_fc2: [out, in] split along ``in`` over tp ranks."""

    dims: tuple[str, str] = ("hidden", "ffn")
    split: ClassVar[str] = ROW

    def hf_shapes(self, shape):
        return [tuple(dim(shape, d) for d in self.dims)]


@dataclass(frozen=True)
class Column(Mapping):
    """One HF tensor [out, in] split along ``out`` over tp ranks (see the module doc)."""

    dims: tuple[str, str] = ("hidden", "hidden")
    split: ClassVar[str] = COLUMN

    def hf_shapes(self, shape):
        return [tuple(dim(shape, d) for d in self.dims)]


@dataclass(frozen=True)
class Vocab(Mapping):
    """Embedding / output layer: [vocab, hidden] padded with zero rows to ``padded_vocab``."""

    split: ClassVar[str] = COLUMN

    def hf_shapes(self, shape):
        return [(shape.vocab_size, shape.hidden_size)]

    def global_shape(self, shape, padded_vocab):
        return (padded_vocab, shape.hidden_size)


@dataclass(frozen=True)
class Gated(Mapping):
    """linear_fc1 = [gate; up] of a SwiGLU MLP with ``ffn`` rows each."""

    ffn: str = "ffn"
    split: ClassVar[str] = GATED

    def hf_shapes(self, shape):
        return [(dim(shape, self.ffn), shape.hidden_size)] * 2


@dataclass(frozen=True)
class QKV(Mapping):
    """linear_qkv (weight or bias) from q, k, v: grouped per query group, see module doc."""

    split: ClassVar[str] = COLUMN

    @property
    def is_bias(self) -> bool:
        return self.hf[0].endswith(".bias")

    def hf_shapes(self, shape):
        tail = () if self.is_bias else (shape.hidden_size,)
        return [(dim(shape, "q"), *tail), (dim(shape, "kv"), *tail), (dim(shape, "kv"), *tail)]

    def to_global(self, shape, names, dst, padded_vocab):
        d, groups = shape.head_dim, shape.num_query_groups
        per_q = shape.num_attention_heads // groups * d
        cols = 1 if self.is_bias else shape.hidden_size
        out, row = [], 0
        for g in range(groups):
            for name, n in zip(names, (per_q, d, d)):
                out.append(whole(name, dst, n, cols, src_row=g * n, dst_row=row))
                row += n
        return out
