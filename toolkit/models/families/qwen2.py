"""Qwen2 / Qwen2.5 (q/k/v bias, small models tie embeddings) and Qwen2-MoE (routed experts + a
shared expert behind a sigmoid gate, every decoder_sparse_step-th layer; layers left dense by
decoder_sparse_step / mlp_only_layers keep the Llama MLP)."""
from __future__ import annotations

from ..family import Family, register
from ..shape import ModelShape, MoEShape
from ..weights import Table
from ._common import (
    ATTENTION,
    DENSE_MLP,
    GATED_SHARED_EXPERT,
    PRE_MLP_NORM,
    QKV_BIAS,
    ROUTED,
    decoder,
    dense_fields,
    dense_hf,
    moe_layers,
    sparse_step,
)

# Megatron-LM checkpoint flags without an HF config (converters.megatron_args.megatron_features)
DENSE_SIGNATURE = {"mla": False, "moe": False, "shared_expert": False,
                   "qk_norm": False, "qkv_bias": True, "partial_rope": False}
MOE_SIGNATURE = {"mla": False, "moe": True, "shared_expert": True,
                 "qk_norm": False, "qkv_bias": True, "partial_rope": False}


def _window(cfg) -> int | None:
    return cfg.sliding_window if getattr(cfg, "use_sliding_window", False) else None


def qwen2_from_hf(cfg) -> ModelShape:
    return ModelShape(architecture="Qwen2ForCausalLM", qkv_bias=True, sliding_window=_window(cfg), **dense_fields(cfg))


def qwen2_to_hf(shape: ModelShape) -> dict:
    d = dense_hf(shape, "qwen2")
    d.pop("head_dim")
    return {**d, "use_sliding_window": shape.sliding_window is not None, "sliding_window": shape.sliding_window}


def qwen2_weights(shape) -> Table:
    return decoder(shape, ATTENTION, QKV_BIAS, PRE_MLP_NORM, DENSE_MLP)


def qwen2_moe_from_hf(cfg) -> ModelShape:
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
    return ModelShape(architecture="Qwen2MoeForCausalLM", qkv_bias=True, sliding_window=_window(cfg), moe=moe,
                      **dense_fields(cfg))


def qwen2_moe_to_hf(shape: ModelShape) -> dict:
    m = shape.moe
    d = dense_hf(shape, "qwen2_moe")
    d.pop("head_dim")
    step = sparse_step(m.layers)
    return {**d, "num_experts": m.num_experts, "num_experts_per_tok": m.topk,
            "moe_intermediate_size": m.ffn_hidden_size,
            "shared_expert_intermediate_size": m.shared_ffn_hidden_size,
            "norm_topk_prob": not m.pre_softmax, "decoder_sparse_step": step,
            "mlp_only_layers": [i for i, s in enumerate(m.layers) if not s and (i + 1) % step == 0],
            "router_aux_loss_coef": m.aux_loss_coeff, "use_sliding_window": False}


def qwen2_moe_weights(shape) -> Table:
    return decoder(shape, ATTENTION, QKV_BIAS, PRE_MLP_NORM, DENSE_MLP, ROUTED, GATED_SHARED_EXPERT)


QWEN2_TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
    "hidden_act": "silu", "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "rope_theta": 1000000.0, "use_sliding_window": False
}
QWEN2_MOE_TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
    "rope_theta": 1000000.0, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128, "norm_topk_prob": False, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "use_sliding_window": False
}

register(Family("qwen2", ("Qwen2ForCausalLM",), qwen2_from_hf, qwen2_to_hf, qwen2_weights,
                megatron_signature=DENSE_SIGNATURE, tiny={"qwen2-tiny": QWEN2_TINY}))
register(Family("qwen2_moe", ("Qwen2MoeForCausalLM",), qwen2_moe_from_hf, qwen2_moe_to_hf, qwen2_moe_weights,
                megatron_signature=MOE_SIGNATURE, tiny={"qwen2-moe-tiny": QWEN2_MOE_TINY},
                hf_forward={"shared_experts": "first"}))
