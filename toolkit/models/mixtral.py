"""Mixtral: every layer is MoE (8 experts, top-2, softmax then renormalise over the 2)."""
from __future__ import annotations

from ._common import dense_fields, dense_hf
from .registry import register_family
from .shape import ModelShape, MoEShape


@register_family("mixtral", "MixtralForCausalLM")
class Mixtral:
    @staticmethod
    def from_hf(cfg) -> ModelShape:
        moe = MoEShape(
            num_experts=cfg.num_local_experts,
            topk=cfg.num_experts_per_tok,
            ffn_hidden_size=cfg.intermediate_size,
            layers=(True,) * cfg.num_hidden_layers,
            aux_loss_coeff=cfg.router_aux_loss_coef,
        )
        return ModelShape(architecture="MixtralForCausalLM", sliding_window=cfg.sliding_window, moe=moe,
                          **dense_fields(cfg))

    @staticmethod
    def to_hf(shape: ModelShape) -> dict:
        m = shape.moe
        return {**dense_hf(shape, "mixtral"), "num_local_experts": m.num_experts,
                "num_experts_per_tok": m.topk, "router_aux_loss_coef": m.aux_loss_coeff,
                "sliding_window": shape.sliding_window}
