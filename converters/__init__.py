"""Exact, streaming HF <-> Megatron-core checkpoint conversion (legacy ``torch`` and
``torch_dist``), checked against transformers and megatron-core themselves.

Public API (used by the CLI and other areas):
  hf_to_megatron, megatron_to_hf, megatron_to_megatron, verify,
  megatron_args / shape_from_args / layout_from_args (a checkpoint's ``args`` <-> ModelShape + Layout),
  Layout, supported (the HF architectures converted).
"""
from .convert import hf_to_megatron, megatron_to_hf, megatron_to_megatron
from .families import supported
from .layout import Layout
from .megatron_args import layout_from_args, megatron_args, shape_from_args


def verify(hf_dir, megatron_dir, *, tolerance: float = 1e-4, **kwargs) -> float:
    """Max |logit difference| between transformers on ``hf_dir`` and megatron-core's GPTModel
    loaded from ``megatron_dir`` at its own layout (see converters.parity)."""
    from .parity import verify as _verify

    return _verify(hf_dir, megatron_dir, tolerance=tolerance, **kwargs)


__all__ = ["Layout", "hf_to_megatron", "layout_from_args", "megatron_args", "megatron_to_hf", "megatron_to_megatron",
           "shape_from_args", "supported", "verify"]
