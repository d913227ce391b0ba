"""Mixtral: Llama attention, every MLP a MoE layer (8 experts, top-2, softmax then renormalise
over the 2; router ``gate``, experts w1/w3/w2)."""
from __future__ import annotations

from ..family import Family, register
from ..shape import ModelShape, MoEShape
from ..weights import MOE, Gated, Replicated, Row, Table
from ._common import ATTENTION, PRE_MLP_NORM, decoder, dense_fields, dense_hf

MOE_MLP: Table = {
    "decoder.layers.{}.mlp.router.weight": Replicated("model.layers.{}.block_sparse_moe.gate.weight",
                                                      dims=("experts", "hidden"), scope=MOE),
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight": Gated((
        "model.layers.{}.block_sparse_moe.experts.{}.w1.weight",
        "model.layers.{}.block_sparse_moe.experts.{}.w3.weight"), ffn="expert_ffn", scope=MOE),
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight": Row(
        "model.layers.{}.block_sparse_moe.experts.{}.w2.weight", dims=("hidden", "expert_ffn"), scope=MOE),
}
# Megatron-LM checkpoint flags without an HF config (converters.megatron_args.megatron_features)
SIGNATURE = {"mla": False, "moe": True, "shared_expert": False,
             "qk_norm": False, "qkv_bias": False, "partial_rope": False}


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


def to_hf(shape: ModelShape) -> dict:
    m = shape.moe
    return {**dense_hf(shape, "mixtral"), "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.topk, "router_aux_loss_coef": m.aux_loss_coeff,
            "sliding_window": shape.sliding_window}


def weights(shape) -> Table:
    return decoder(shape, ATTENTION, PRE_MLP_NORM, MOE_MLP)


MIXTRAL_TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-05,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
    "rope_theta": 1000000.0, "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
    "sliding_window": None
}

register(Family("mixtral", ("MixtralForCausalLM",), from_hf, to_hf, weights, megatron_signature=SIGNATURE,
                tiny={"mixtral-tiny": MIXTRAL_TINY}))
