"""Weight-name tables, one file per model family, registered by HF architecture.

A table maps each Megatron name (local-spec names, ``{}`` = global layer number, then
global expert number) to a typed mapping from converters.fused naming the HF tensors.
It is written once, HF <-> Megatron; every direction is derived from it.

Multi-token prediction modules (``mtp.layers.{}.*`` entries, DeepSeek-V3) are expanded for
k < shape.mtp_layers with HF layer number num_layers + k; each holds a decoder layer
(``mtp.layers.k.transformer_layer.*``: the table's decoder-layer entries, of the kind of the
last decoder layer, as megatron builds it). An HF alias is an HF tensor that is a copy of
another (megatron keeps one): registered with ``@hf_aliases``.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

from toolkit.models import ModelShape, UnsupportedArchitectureError

from ..errors import UnsupportedModelError
from ..fused import DENSE, MOE, Mapping

Table = dict[str, Mapping]
TABLES: dict[str, Callable[[ModelShape], Table]] = {}
ALIASES: dict[str, Callable[[ModelShape], dict[str, str]]] = {}
PROBLEMS: dict[str, Callable] = {}
LAYER, MTP = "decoder.layers.{}.", "mtp.layers.{}."
MTP_LAYER = MTP + "transformer_layer."


def weight_table(*architectures: str):
    """Decorator: ``fn(shape) -> Table`` is the table of these HF architectures."""

    def wrap(fn):
        for arch in architectures:
            TABLES[arch] = fn
        return fn

    return wrap


def hf_aliases(*architectures: str):
    """Decorator: ``fn(shape) -> {alias HF name: HF name it copies}`` for these architectures."""

    def wrap(fn):
        for arch in architectures:
            ALIASES[arch] = fn
        return fn

    return wrap


def conversion_problems(*architectures: str):
    """Decorator: ``fn(shape, hf_config) -> [reasons]``: what megatron-core would compute
    differently from transformers for this model (it is then refused, never converted).
    ``hf_config`` has the attributes of transformers' config object (toolkit.models.hf_json:
    config.json with the class defaults and rope normalisation, read without transformers)."""

    def wrap(fn):
        for arch in architectures:
            PROBLEMS[arch] = fn
        return fn

    return wrap


@lru_cache(maxsize=1)
def _load() -> None:
    from . import deepseek, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe  # noqa: F401  (they register themselves)


def supported() -> list[str]:
    _load()
    return sorted(TABLES)


def check_supported(architecture: str) -> None:
    if architecture not in supported():
        raise UnsupportedArchitectureError(
            f"unsupported architecture '{architecture}' for conversion; supported: {', '.join(supported())}")


def check_convertible(shape: ModelShape) -> None:
    """Raise UnsupportedModelError with every reason megatron-core would compute another model."""
    check_supported(shape.architecture)
    fn = PROBLEMS.get(shape.architecture)
    if fn is None or not shape.hf_config:
        return
    from toolkit.models.hf_json import hf_view

    problems = fn(shape, hf_view(shape.hf_config))
    if problems:
        raise UnsupportedModelError(f"{shape.architecture} cannot be converted exactly: " + "; ".join(problems))


def table_for(shape: ModelShape) -> Table:
    check_convertible(shape)
    return TABLES[shape.architecture](shape)


def aliases_for(shape: ModelShape) -> dict[str, str]:
    _load()
    fn = ALIASES.get(shape.architecture)
    return fn(shape) if fn else {}


def without_output_when_tied(shape: ModelShape, table: Table) -> Table:
    """Tied embeddings: no output_layer (megatron reuses the embedding; HF has no lm_head)."""
    return {k: v for k, v in table.items() if not (shape.tie_embeddings and k == "output_layer.weight")}


@dataclass(frozen=True)
class Entry:
    """One global Megatron tensor of a model: its name, mapping and HF tensor names."""

    name: str
    mapping: Mapping
    hf: tuple[str, ...]
    layer: int | None = None
    expert: int | None = None


def _applies(shape: ModelShape, scope: str, layer: int) -> bool:
    """Dense-MLP entries skip MoE layers and MoE entries skip dense ones."""
    return scope not in (DENSE, MOE) or shape.is_moe_layer(layer) == (scope == MOE)


def _expand_one(shape: ModelShape, pattern: str, m: Mapping, layer: int, hf_layer: int | None = None) -> list[Entry]:
    """``pattern`` at megatron number ``layer`` (HF number ``hf_layer``, default the same)."""
    hf_layer = layer if hf_layer is None else hf_layer
    at = layer if pattern.startswith(LAYER) else None
    if pattern.count("{}") == 1:
        return [Entry(pattern.format(layer), m, tuple(h.format(hf_layer) for h in m.hf), at)]
    return [Entry(pattern.format(layer, e), m, tuple(h.format(hf_layer, e) for h in m.hf), at, e)
            for e in range(shape.moe.num_experts)]


def _mtp(shape: ModelShape, table: Table) -> list[Entry]:
    """The MTP modules: their own entries, then their decoder layer's."""
    out = []
    for k in range(shape.mtp_layers):
        hf_layer = shape.num_layers + k
        for pattern, m in table.items():
            if pattern.startswith(MTP):
                out += _expand_one(shape, pattern, m, k, hf_layer)
            elif pattern.startswith(LAYER) and _applies(shape, m.scope, shape.num_layers - 1):
                out += _expand_one(shape, MTP_LAYER + pattern[len(LAYER):], m, k, hf_layer)
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


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_NAME = re.compile(r"^mtp\.layers\.(\d+)\.")


def with_mtp(shape: ModelShape, names, hf: bool) -> ModelShape:
    """The shape with as many MTP modules as the weights hold: HF layers numbered from
    num_layers on (``hf``), or megatron's ``mtp.layers.K``. Only families whose table has
    MTP entries have them (elsewhere such tensors stay unexpected and are refused)."""
    _load()
    if not any(p.startswith(MTP) for p in TABLES.get(shape.architecture, lambda s: {})(shape)):
        return shape
    found = set()
    for name in names:
        m = _HF_LAYER.match(name) if hf else _MTP_NAME.match(getattr(name, "name", name))
        if m and (not hf or int(m.group(1)) >= shape.num_layers):
            found.add(int(m.group(1)) - (shape.num_layers if hf else 0))
    return replace(shape, mtp_layers=max(found) + 1 if found else 0)
