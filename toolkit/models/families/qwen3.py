"""Qwen3 (q/k RMSNorm per head, head_dim independent of hidden/heads) and Qwen3-MoE (many
fine-grained routed experts, renormalised top-k, no shared expert)."""
from __future__ import annotations

from ...errors import SpecError
from ..family import Family, register
from ..shape import ModelShape, MoEShape
from ..weights import Table
from ._common import (
    ATTENTION,
    DENSE_MLP,
    PRE_MLP_NORM,
    QK_NORM,
    ROUTED,
    decoder,
    dense_fields,
    dense_hf,
    moe_layers,
    sparse_step,
)

# Megatron-LM checkpoint flags without an HF config (converters.megatron_args.megatron_features)
DENSE_SIGNATURE = {"mla": False, "moe": False, "shared_expert": False,
                   "qk_norm": True, "qkv_bias": False, "partial_rope": False}
MOE_SIGNATURE = {"mla": False, "moe": True, "shared_expert": False,
                 "qk_norm": True, "qkv_bias": False, "partial_rope": False}


def _check(cfg) -> None:
    if getattr(cfg, "attention_bias", False):
        raise SpecError(f"{cfg.config_class} with attention_bias=true is not supported")


def qwen3_from_hf(cfg) -> ModelShape:
    _check(cfg)
    return ModelShape(architecture="Qwen3ForCausalLM", qk_norm=True, **dense_fields(cfg))


def qwen3_to_hf(shape: ModelShape) -> dict:
    return {**dense_hf(shape, "qwen3"), "attention_bias": False}


def qwen3_weights(shape) -> Table:
    return decoder(shape, ATTENTION, QK_NORM, PRE_MLP_NORM, DENSE_MLP)


def qwen3_moe_from_hf(cfg) -> ModelShape:
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


def qwen3_moe_to_hf(shape: ModelShape) -> dict:
    m = shape.moe
    step = sparse_step(m.layers)
    return {**dense_hf(shape, "qwen3_moe"), "attention_bias": False,
            "num_experts": m.num_experts, "num_experts_per_tok": m.topk,
            "moe_intermediate_size": m.ffn_hidden_size, "norm_topk_prob": not m.pre_softmax,
            "decoder_sparse_step": step,
            "mlp_only_layers": [i for i, s in enumerate(m.layers) if not s and (i + 1) % step == 0],
            "router_aux_loss_coef": m.aux_loss_coeff}


def qwen3_moe_weights(shape) -> Table:
    return decoder(shape, ATTENTION, QK_NORM, PRE_MLP_NORM, DENSE_MLP, ROUTED)


QWEN3_TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "rope_theta": 1000000.0, "head_dim": 32, "attention_bias": False
}
QWEN3_MOE_TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "rope_theta": 1000000.0, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001, "attention_bias": False
}

# transformers' Qwen3 attention normalises q right after q_proj and k after k_proj (params.hf_layer_weights)
HF_FORWARD = {"qk_norm": "each"}
register(Family("qwen3", ("Qwen3ForCausalLM",), qwen3_from_hf, qwen3_to_hf, qwen3_weights,
                megatron_signature=DENSE_SIGNATURE, tiny={"qwen3-tiny": QWEN3_TINY}, hf_forward=HF_FORWARD))
register(Family("qwen3_moe", ("Qwen3MoeForCausalLM",), qwen3_moe_from_hf, qwen3_moe_to_hf, qwen3_moe_weights,
                megatron_signature=MOE_SIGNATURE, tiny={"qwen3-moe-tiny": QWEN3_MOE_TINY}, hf_forward=HF_FORWARD))
