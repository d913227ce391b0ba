"""Qwen2 / Qwen2.5 (q/k/v bias, small models tie embeddings) and Qwen2-MoE
(routed experts + a shared expert behind a sigmoid gate, every decoder_sparse_step-th layer)."""
from __future__ import annotations

from ._common import dense_fields, dense_hf
from .registry import register_family
from .shape import ModelShape, MoEShape


def _window(cfg) -> int | None:
    return cfg.sliding_window if getattr(cfg, "use_sliding_window", False) else None


@register_family("qwen2", "Qwen2ForCausalLM")
class Qwen2:
    @staticmethod
    def from_hf(cfg) -> ModelShape:
        return ModelShape(architecture="Qwen2ForCausalLM", qkv_bias=True, sliding_window=_window(cfg),
                          **dense_fields(cfg))

    @staticmethod
    def to_hf(shape: ModelShape) -> dict:
        d = dense_hf(shape, "qwen2")
        d.pop("head_dim")
        return {**d, "use_sliding_window": shape.sliding_window is not None,
                "sliding_window": shape.sliding_window}


def moe_layers(num_layers: int, step: int, dense_only: list[int]) -> tuple[bool, ...]:
    """Qwen2/3-MoE: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and not in mlp_only_layers."""
    return tuple((i + 1) % step == 0 and i not in dense_only for i in range(num_layers))


@register_family("qwen2_moe", "Qwen2MoeForCausalLM")
class Qwen2Moe:
    @staticmethod
    def from_hf(cfg) -> ModelShape:
        moe = MoEShape(
            num_experts=cfg.num_experts,
            topk=cfg.num_experts_per_tok,
            ffn_hidden_size=cfg.moe_intermediate_size,
            layers=moe_layers(cfg.num_hidden_layers, cfg.decoder_sparse_step, list(cfg.mlp_only_layers or [])),
            shared_ffn_hidden_size=cfg.shared_expert_intermediate_size,
            shared_expert_gate=True,
            pre_softmax=not cfg.norm_topk_prob,
            aux_loss_coeff=cfg.router_aux_loss_coef,
        )
        return ModelShape(architecture="Qwen2MoeForCausalLM", qkv_bias=True, sliding_window=_window(cfg),
                          moe=moe, **dense_fields(cfg))

    @staticmethod
    def to_hf(shape: ModelShape) -> dict:
        m = shape.moe
        d = dense_hf(shape, "qwen2_moe")
        d.pop("head_dim")
        step = _sparse_step(m.layers)
        return {**d, "num_experts": m.num_experts, "num_experts_per_tok": m.topk,
                "moe_intermediate_size": m.ffn_hidden_size,
                "shared_expert_intermediate_size": m.shared_ffn_hidden_size,
                "norm_topk_prob": not m.pre_softmax, "decoder_sparse_step": step,
                "mlp_only_layers": [i for i, s in enumerate(m.layers) if not s and (i + 1) % step == 0],
                "router_aux_loss_coef": m.aux_loss_coeff, "use_sliding_window": False}


def _sparse_step(layers: tuple[bool, ...]) -> int:
    """Smallest step whose pattern covers every sparse layer (the rest go to mlp_only_layers)."""
    for step in range(1, len(layers) + 1):
        if all((i + 1) % step == 0 for i, s in enumerate(layers) if s):
            return step
    return 1
