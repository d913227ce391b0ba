"""Exact, streaming HF <-> Megatron-core checkpoint conversion (legacy ``torch`` and
``torch_dist``), checked against transformers and megatron-core themselves.

Public API (used by the CLI and other areas):
  hf_to_megatron, megatron_to_hf, megatron_to_megatron, verify,
  shape_from_args / layout_from_args (a checkpoint's ``args`` -> ModelShape, Layout),
  Layout, supported (the HF architectures converted).
A checkpoint's ``args`` are made by ``converters.megatron_args.megatron_args``: the package does
not name that function, because its module of the same name would replace it as the package's
attribute once imported.
Each name is imported when first used (PEP 562), so that a module of the package (a format
reader the training runtime uses) loads without the conversion machinery and the planner.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"hf_to_megatron": ".convert", "megatron_to_hf": ".convert", "megatron_to_megatron": ".convert",
          "supported": "toolkit.models.family", "Layout": "toolkit.parallel.layout", "layout_from_args": ".megatron_args",
          "shape_from_args": ".megatron_args"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'converters' has no attribute '{name}'")
    return getattr(importlib.import_module(_WHERE[name], __name__), name)


def verify(hf_dir, megatron_dir, *, tolerance: float = 1e-4, **kwargs) -> float:
    """Max |logit difference| between transformers on ``hf_dir`` and megatron-core's GPTModel
    loaded from ``megatron_dir`` at its own layout (see converters.parity)."""
    from .parity import verify as _verify

    return _verify(hf_dir, megatron_dir, tolerance=tolerance, **kwargs)


__all__ = ["Layout", "hf_to_megatron", "layout_from_args", "megatron_to_hf", "megatron_to_megatron",
           "shape_from_args", "supported", "verify"]
