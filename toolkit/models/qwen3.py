"""Qwen3 (q/k RMSNorm per head, head_dim independent of hidden/heads) and Qwen3-MoE
(many fine-grained experts, renormalised top-k, no shared expert)."""
from __future__ import annotations

from ..errors import SpecError
from ._common import dense_fields, dense_hf
from .qwen2 import _sparse_step, moe_layers
from .registry import register_family
from .shape import ModelShape, MoEShape


def _check(cfg) -> None:
    if getattr(cfg, "attention_bias", False):
        raise SpecError(f"{cfg.config_class} with attention_bias=true is not supported")


@register_family("qwen3", "Qwen3ForCausalLM")
class Qwen3:
    @staticmethod
    def from_hf(cfg) -> ModelShape:
        _check(cfg)
        return ModelShape(architecture="Qwen3ForCausalLM", qk_norm=True, **dense_fields(cfg))

    @staticmethod
    def to_hf(shape: ModelShape) -> dict:
        return {**dense_hf(shape, "qwen3"), "attention_bias": False}


@register_family("qwen3_moe", "Qwen3MoeForCausalLM")
class Qwen3Moe:
    @staticmethod
    def from_hf(cfg) -> ModelShape:
        _check(cfg)
        moe = MoEShape(
            num_experts=cfg.num_experts,
            topk=cfg.num_experts_per_tok,
            ffn_hidden_size=cfg.moe_intermediate_size,
            layers=moe_layers(cfg.num_hidden_layers, cfg.decoder_sparse_step, list(cfg.mlp_only_layers or [])),
            pre_softmax=not cfg.norm_topk_prob,
            aux_loss_coeff=cfg.router_aux_loss_coef,
        )
        return ModelShape(architecture="Qwen3MoeForCausalLM", qk_norm=True, moe=moe, **dense_fields(cfg))

    @staticmethod
    def to_hf(shape: ModelShape) -> dict:
        m = shape.moe
        step = _sparse_step(m.layers)
        return {**dense_hf(shape, "qwen3_moe"), "attention_bias": False,
                "num_experts": m.num_experts, "num_experts_per_tok": m.topk,
                "moe_intermediate_size": m.ffn_hidden_size, "norm_topk_prob": not m.pre_softmax,
                "decoder_sparse_step": step,
                "mlp_only_layers": [i for i, s in enumerate(m.layers) if not s and (i + 1) % step == 0],
                "router_aux_loss_coef": m.aux_loss_coeff}
