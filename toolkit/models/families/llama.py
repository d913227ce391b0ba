"""Llama 2 / 3 / 3.1 and Mistral: GQA, RMSNorm, SwiGLU, RoPE (Llama 3.1: llama3 rope scaling;
Mistral: a sliding window)."""
from __future__ import annotations

from ...errors import SpecError
from ..family import Family, register
from ..shape import ModelShape
from ..weights import Table
from ._common import ATTENTION, DENSE_MLP, PRE_MLP_NORM, decoder, dense_fields, dense_hf

# Megatron-LM checkpoint flags without an HF config (converters.megatron_args.megatron_features)
PLAIN = {"mla": False, "moe": False, "shared_expert": False, "qk_norm": False, "qkv_bias": False, "partial_rope": False}


def llama_from_hf(cfg) -> ModelShape:
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(cfg, flag, False):
            raise SpecError(f"LlamaForCausalLM with {flag}=true is not supported")
    return ModelShape(architecture="LlamaForCausalLM", **dense_fields(cfg))


def llama_to_hf(shape: ModelShape) -> dict:
    return {**dense_hf(shape, "llama"), "attention_bias": False, "mlp_bias": False}


def mistral_from_hf(cfg) -> ModelShape:
    return ModelShape(architecture="MistralForCausalLM", sliding_window=cfg.sliding_window, **dense_fields(cfg))


def mistral_to_hf(shape: ModelShape) -> dict:
    return {**dense_hf(shape, "mistral"), "sliding_window": shape.sliding_window}


def weights(shape) -> Table:
    return decoder(shape, ATTENTION, PRE_MLP_NORM, DENSE_MLP)


LLAMA_TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-05,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
    "attention_bias": False, "mlp_bias": False
}
MISTRAL_TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-05,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "architectures": ["MistralForCausalLM"], "model_type": "mistral",
    "rope_theta": 10000.0, "sliding_window": None
}

register(Family("llama", ("LlamaForCausalLM",), llama_from_hf, llama_to_hf, weights, megatron_signature=PLAIN,
                tiny={"llama-tiny": LLAMA_TINY}))
register(Family("mistral", ("MistralForCausalLM",), mistral_from_hf, mistral_to_hf, weights,
                tiny={"mistral-tiny": MISTRAL_TINY}))
