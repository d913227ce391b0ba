"""Llama 2 / 3 / 3.1 and Mistral: GQA, RMSNorm, SwiGLU, RoPE (Llama 3.1: llama3 rope scaling)."""
from __future__ import annotations

from ..errors import SpecError
from ._common import dense_fields, dense_hf
from .registry import register_family
from .shape import ModelShape


@register_family("llama", "LlamaForCausalLM")
class Llama:
    @staticmethod
    def from_hf(cfg) -> ModelShape:
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(cfg, flag, False):
                raise SpecError(f"LlamaForCausalLM with {flag}=true is not supported")
        return ModelShape(architecture="LlamaForCausalLM", **dense_fields(cfg))

    @staticmethod
    def to_hf(shape: ModelShape) -> dict:
        return {**dense_hf(shape, "llama"), "attention_bias": False, "mlp_bias": False}


@register_family("mistral", "MistralForCausalLM")
class Mistral:
    @staticmethod
    def from_hf(cfg) -> ModelShape:
        return ModelShape(architecture="MistralForCausalLM", sliding_window=cfg.sliding_window,
                          **dense_fields(cfg))

    @staticmethod
    def to_hf(shape: ModelShape) -> dict:
        return {**dense_hf(shape, "mistral"), "sliding_window": shape.sliding_window}
