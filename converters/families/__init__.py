"""Weight-name tables, one file per model family, registered by HF architecture.

A table maps each Megatron name (local-spec names, ``{}`` = global layer number, then
global expert number) to a typed mapping from converters.fused naming the HF tensors.
It is written once, HF <-> Megatron; every direction is derived from it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from toolkit.models import ModelShape, UnsupportedArchitectureError

from ..fused import DENSE, MOE, Mapping

Table = dict[str, Mapping]
TABLES: dict[str, Callable[[ModelShape], Table]] = {}


def weight_table(*architectures: str):
    """Decorator: ``fn(shape) -> Table`` is the table of these HF architectures."""

    def wrap(fn):
        for arch in architectures:
            TABLES[arch] = fn
        return fn

    return wrap


@lru_cache(maxsize=1)
def _load() -> None:
    from . import llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe  # noqa: F401  (they register themselves)


def supported() -> list[str]:
    _load()
    return sorted(TABLES)


def check_supported(architecture: str) -> None:
    if architecture not in supported():
        raise UnsupportedArchitectureError(
            f"unsupported architecture '{architecture}' for conversion; supported: {', '.join(supported())}")


def table_for(shape: ModelShape) -> Table:
    check_supported(shape.architecture)
    return TABLES[shape.architecture](shape)


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


def _expand_one(shape: ModelShape, pattern: str, m: Mapping, layer: int) -> list[Entry]:
    if pattern.count("{}") == 1:
        return [Entry(pattern.format(layer), m, tuple(h.format(layer) for h in m.hf), layer)]
    return [Entry(pattern.format(layer, e), m, tuple(h.format(layer, e) for h in m.hf), layer, e)
            for e in range(shape.moe.num_experts)]


def expand(shape: ModelShape, table: Table) -> list[Entry]:
    """Every tensor of the model in Megatron module order: embedding, layer by layer, head."""
    head = [Entry(k, m, m.hf) for k, m in table.items() if "{}" not in k]
    first = [e for e in head if e.name.startswith("embedding.")]
    last = [e for e in head if not e.name.startswith("embedding.")]
    body = [entry for layer in range(shape.num_layers) for pattern, m in table.items()
            if "{}" in pattern and _applies(shape, m.scope, layer)
            for entry in _expand_one(shape, pattern, m, layer)]
    return first + body + last
