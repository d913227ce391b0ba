"""How a model's weights are named and laid out on both sides, HF and megatron-core.

A family's weight table maps each megatron name (local-spec names, ``{}`` = global layer
number, then global expert number) to a typed mapping naming the HF tensors; it is written
once, HF <-> megatron, and every direction is derived from it (the converters, the runtime's
export, the live weight bridge). The mappings (below) know the shapes of the HF tensors, how
they are laid out in the one global megatron tensor (fused QKV, gated MLP halves, padded
vocabulary) and how that tensor is split over tensor-parallel ranks:
  QKV    [G, (H/G)*d + d + d, h]: per query group its H/G query heads, its key, its value;
         a tp rank holds a contiguous 1/tp of the groups (needs G % tp == 0).
  Gated  linear_fc1 = [gate; up]; tp rank i holds [gate chunk i; up chunk i].
  Vocab  [padded_vocab, h]: rows past the HF vocabulary are zero; column-split.
  Row    linear_proj / linear_fc2: split along the input (column) dimension.
  Parts  rows of several parts one after the other; tp rank i holds chunk i of each part
         (megatron's gated delta net in_proj: q, k, v, z, b, a; conv1d: q, k, v).
  Column one HF tensor as it is, split along its rows (output dimension). Multi-latent
         attention (DeepSeek) needs nothing more: HF and megatron-core lay out q_b_proj /
         linear_q_up_proj as [heads, nope + rope] rows and kv_b_proj / linear_kv_up_proj as
         [heads, k_nope + v] rows, so a tp rank's contiguous 1/tp of the rows is its
         heads; the latent down-projections (local spec: column-parallel, all-gathered
         right after) split their [q_lora] / [kv_lora + rope] rows the same way; rope
         dims need no permutation (megatron de-interleaves them itself with
         multi_latent_attention, as transformers' interleaved rope does).
Multi-token prediction modules (``mtp.layers.{}.*`` entries) are expanded for k <
shape.mtp_layers with HF layer number num_layers + k; each holds a decoder layer
(``mtp.layers.k.transformer_layer.*``: the table's decoder-layer entries, of the kind of the
last decoder layer, as megatron builds it). A family whose MTP entries name HF tensors under
``mtp.`` (Qwen3-Next's checkpoints keep the module apart: ``mtp.fc``, ``mtp.layers.k.*``) has
its MTP decoder layer under HF's ``mtp.layers.k.`` instead (``apart_mtp``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import ClassVar

from ..regions import Copy, as_2d, whole
from .shape import ModelShape

# Split styles (how layer B divides a global tensor over tp or expert-tp ranks).
REPLICATED, COLUMN, ROW, GATED = "replicated", "column", "row", "gated"
PARTS = "parts"  # rows of several parts one after the other, each part split over tp (Mapping.parts)
DENSE, MOE, ALL = "dense", "moe", "all"  # which decoder layers a layer entry applies to
# ... by token mixer, in a model with gated delta net layers (Qwen3-Next)
SOFTMAX, LINEAR = "softmax_attention", "linear_attention"


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
        "heads": shape.num_attention_heads,
        "q": shape.num_attention_heads * shape.head_dim, "kv": shape.num_query_groups * shape.head_dim,
        "ffn": shape.ffn_hidden_size, "experts": m.num_experts if m else 0,
        "expert_ffn": m.ffn_hidden_size if m else 0, "shared_ffn": m.shared_ffn_hidden_size if m else 0,
        "hidden2": 2 * shape.hidden_size, **_mla_dims(shape), **_linear_dims(shape),
    }[name]


def _linear_dims(shape: ModelShape) -> dict[str, int]:
    la = shape.linear_attention
    if la is None:
        return {}
    return {"value_heads": la.value_heads, "value_head_dim": la.value_head_dim, "v_dim": la.v_dim,
            "conv": la.conv_dim, "conv_kernel": la.conv_kernel}


@dataclass(frozen=True)
class Mapping:
    """One global Megatron tensor from ``hf`` tensors (name patterns, ``{}`` = layer, expert)."""

    hf: tuple[str, ...] | str
    scope: str = ALL
    # a dtype this tensor keeps whatever --dtype says (megatron and transformers keep the
    # aux-loss-free expert bias in fp32); None: it follows --dtype like the rest
    keep_dtype: str | None = None  # a dtype name, e.g. "float32"
    # megatron's value = HF's + shift (a norm megatron applies as (1 + w) where transformers
    # applies w: Qwen3-Next's gated delta net norm, -1); 0: the bytes are copied
    shift: float = 0.0
    split: ClassVar[str] = REPLICATED
    # the parts' names in megatron's torch_dist keys (``<name>.<part>``) of a PARTS-split tensor
    part_names: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))

    def parts(self, shape: ModelShape) -> tuple[int, ...]:
        """Rows of each part of a PARTS-split tensor (a tp rank holds its share of every part,
        one after the other: megatron's gated delta net in_proj and conv1d)."""
        raise NotImplementedError(f"{type(self).__name__} is not split by parts")

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


Table = dict[str, Mapping]


def scoped(table: Table, scope: str) -> Table:
    """The table's entries for the layers of this scope only (e.g. the softmax-attention layers
    of a model with gated delta net layers: SOFTMAX)."""
    return {k: replace(m, scope=scope) for k, m in table.items()}


LAYER, MTP = "decoder.layers.{}.", "mtp.layers.{}."
MTP_LAYER = MTP + "transformer_layer."
HF_LAYER, HF_MTP = "model.layers.{}.", "mtp."  # HF: a decoder layer; a module kept apart from them


@dataclass(frozen=True)
class Entry:
    """One global Megatron tensor of a model: its name, mapping and HF tensor names."""

    name: str
    mapping: Mapping
    hf: tuple[str, ...]
    layer: int | None = None
    expert: int | None = None


def _applies(shape: ModelShape, scope: str, layer: int) -> bool:
    """Dense-MLP entries skip MoE layers and MoE entries skip dense ones; softmax-attention
    entries skip gated delta net layers and delta net entries the others."""
    if scope in (SOFTMAX, LINEAR):
        return shape.is_linear_attention_layer(layer) == (scope == LINEAR)
    return scope not in (DENSE, MOE) or shape.is_moe_layer(layer) == (scope == MOE)


def _expand_one(shape: ModelShape, pattern: str, m: Mapping, layer: int, hf_layer: int | None = None) -> list[Entry]:
    """``pattern`` at megatron number ``layer`` (HF number ``hf_layer``, default the same)."""
    hf_layer = layer if hf_layer is None else hf_layer
    at = layer if pattern.startswith(LAYER) else None
    if pattern.count("{}") == 1:
        return [Entry(pattern.format(layer), m, tuple(h.format(hf_layer) for h in m.hf), at)]
    return [Entry(pattern.format(layer, e), m, tuple(h.format(hf_layer, e) for h in m.hf), at, e)
            for e in range(shape.moe.num_experts)]


def apart_mtp(table: Table) -> bool:
    """Whether the checkpoint keeps its MTP modules apart from the decoder layers (their HF
    names under ``mtp.``, numbered from 0: Qwen3-Next) rather than as HF layers num_layers + k
    (DeepSeek-V3, GLM-4.5)."""
    return any(h.startswith(HF_MTP) for p, m in table.items() if p.startswith(MTP) for h in m.hf)


def _mtp_layer_hf(m: Mapping) -> Mapping:
    """A decoder-layer mapping with its HF names under ``mtp.layers.{}.`` (apart_mtp)."""
    if not all(h.startswith(HF_LAYER) for h in m.hf):  # a table error, not the user's
        raise ValueError(f"decoder-layer HF names {m.hf} outside {HF_LAYER}: no MTP-layer name for them")
    return replace(m, hf=tuple(HF_MTP + "layers.{}." + h[len(HF_LAYER):] for h in m.hf))


def _mtp(shape: ModelShape, table: Table) -> list[Entry]:
    """The MTP modules: their own entries, then their decoder layer's."""
    out, apart = [], apart_mtp(table)
    for k in range(shape.mtp_layers):
        hf_layer = k if apart else shape.num_layers + k
        for pattern, m in table.items():
            if pattern.startswith(MTP):
                out += _expand_one(shape, pattern, m, k, hf_layer)
            elif pattern.startswith(LAYER) and _applies(shape, m.scope, shape.num_layers - 1):
                out += _expand_one(shape, MTP_LAYER + pattern[len(LAYER):], _mtp_layer_hf(m) if apart else m, k,
                                   hf_layer)
    return out


def expand(shape: ModelShape, table: Table) -> list[Entry]:
    """Every tensor of the model in Megatron module order: embedding, layer by layer, final
    norm, MTP modules, output layer."""
    head = [Entry(k, m, m.hf) for k, m in table.items() if "{}" not in k]
    first = [e for e in head if e.name.startswith("embedding.")]
    last = [e for e in head if not e.name.startswith("embedding.")]
    body = [entry for layer in range(shape.num_layers) for pattern, m in table.items()
            if pattern.startswith(LAYER) and _applies(shape, m.scope, layer)
            for entry in _expand_one(shape, pattern, m, layer)]
    output = [e for e in last if e.name.startswith("output_layer.")]
    return first + body + [e for e in last if e not in output] + _mtp(shape, table) + output


def has_mtp(table: Table) -> bool:
    """Whether a weight table has multi-token prediction modules (``mtp.layers.{}.*`` entries)."""
    return any(p.startswith(MTP) for p in table)


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_NAME = re.compile(r"^mtp\.layers\.(\d+)\.")


def with_mtp(shape: ModelShape, table: Table, names, hf: bool) -> ModelShape:
    """The shape with as many MTP modules as the weights hold: HF layers numbered from
    num_layers on (``hf``; ``mtp.layers.K`` where the checkpoint keeps them apart), or
    megatron's ``mtp.layers.K``. Only families whose table has MTP entries have them
    (elsewhere such tensors stay unexpected and are refused)."""
    if not has_mtp(table):
        return shape
    found, apart = set(), apart_mtp(table)
    for name in names:
        if hf and not apart:
            m = _HF_LAYER.match(name)
            if m and int(m.group(1)) >= shape.num_layers:
                found.add(int(m.group(1)) - shape.num_layers)
        elif (m := _MTP_NAME.match(getattr(name, "name", name))):
            found.add(int(m.group(1)))
    return replace(shape, mtp_layers=max(found) + 1 if found else 0)
