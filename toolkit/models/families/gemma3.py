"""Gemma 3, text only (transformers' Gemma3ForCausalLM, model_type ``gemma3_text``; the 4B/12B/27B
checkpoints hold this decoder as the ``text_config`` of Gemma3ForConditionalGeneration).

A Llama-style decoder (GQA, q/k RMSNorm per head, rope on whole heads, tied embeddings) with:
  - sliding-window attention on most layers (``layer_types``; older configs: every
    ``sliding_window_pattern``-th layer global, 5 local : 1 global), a token seeing itself and the
    ``sliding_window - 1`` before it (megatron's window_size (sliding_window - 1, 0));
  - two rope bases: ``rope_local_base_freq`` on the sliding layers, ``rope_theta`` (with the
    linear ``rope_scaling`` of 4B+) on the global ones (transformers 5: ``rope_parameters``
    per layer type);
  - norms before and after attention and the MLP (input_layernorm, post_attention_layernorm,
    pre_feedforward_layernorm, post_feedforward_layernorm), every norm (q/k and final too)
    applying (1 + w): megatron's layernorm_zero_centered_gamma, the weights copied unchanged;
  - GeGLU with tanh-approximated GELU (hidden_activation gelu_pytorch_tanh);
  - the word embeddings times sqrt(hidden_size), cast to the weights' dtype;
  - attention scores scaled by query_pre_attn_scalar ** -0.5 (megatron's softmax_scale).
The post-norms, (1 + w) norms on megatron's local spec, the local rope and the embedding scale are
built by the toolkit's modules (toolkit.mcore.layers). Soft-capping (None in Gemma 3) and
bidirectional attention are refused.
"""
from __future__ import annotations

from ...errors import SpecError
from ..family import Family, register
from ..shape import ModelShape
from ..weights import Replicated, Table
from ._common import ATTENTION, DENSE_MLP, FULL, QK_NORM, SLIDING, decoder, dense_hf, layer_types, window_layers

ACTIVATION = "gelu_pytorch_tanh"
PATTERN = 6  # Gemma3TextConfig: kwargs.get("sliding_window_pattern", 6)

NORMS: Table = {  # Gemma's four norms per layer (megatron's local spec names; Megatron-Bridge's post-norm names)
    "decoder.layers.{}.input_layernorm.weight": Replicated("model.layers.{}.input_layernorm.weight"),
    "decoder.layers.{}.self_attention.linear_proj.post_layernorm.weight": Replicated(
        "model.layers.{}.post_attention_layernorm.weight"),
    "decoder.layers.{}.pre_mlp_layernorm.weight": Replicated("model.layers.{}.pre_feedforward_layernorm.weight"),
    "decoder.layers.{}.mlp.linear_fc2.post_layernorm.weight": Replicated(
        "model.layers.{}.post_feedforward_layernorm.weight"),
}


def _rope(cfg) -> tuple[dict, dict]:
    """(full-attention, sliding-attention) rope parameters."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if FULL not in params or SLIDING not in params:
        raise SpecError(f"{cfg.config_class} has no rope_parameters per layer type ('{FULL}', '{SLIDING}')")
    return dict(params[FULL]), dict(params[SLIDING])


def from_hf(cfg) -> ModelShape:
    act = getattr(cfg, "hidden_activation", None) or ACTIVATION
    if act != ACTIVATION:
        raise SpecError(f"hidden_activation='{act}' is not supported (Gemma 3's GeGLU uses '{ACTIVATION}')")
    if getattr(cfg, "attention_bias", False):
        raise SpecError(f"{cfg.config_class} with attention_bias=true is not supported")
    full, local = _rope(cfg)
    theta = float(full.pop("rope_theta"))
    windows = window_layers(cfg, getattr(cfg, "sliding_window_pattern", None) or PATTERN)
    heads = cfg.num_attention_heads
    return ModelShape(
        architecture="Gemma3ForCausalLM", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers, num_attention_heads=heads,
        num_query_groups=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, ffn_hidden_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=theta,
        rope_scaling=None if full.get("rope_type", "default") == "default" else full, norm_eps=cfg.rms_norm_eps,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)), attention_dropout=float(cfg.attention_dropout),
        activation="geglu_tanh", qk_norm=True, sliding_window=cfg.sliding_window,
        window_layers=windows, local_rope_theta=float(local["rope_theta"]),
        zero_centered_norm=True, post_norms=True, embedding_scale=cfg.hidden_size ** 0.5,
        softmax_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
    )


def to_hf(shape: ModelShape) -> dict:
    d = dense_hf(shape, "gemma3_text")
    del d["hidden_act"]
    local = {"rope_type": "default", "rope_theta": shape.local_rope_theta}
    return {**d, "rope_parameters": {FULL: d["rope_parameters"], SLIDING: local},
            "hidden_activation": ACTIVATION, "attention_bias": False, "sliding_window": shape.sliding_window,
            "layer_types": layer_types(shape.window_layers),
            "query_pre_attn_scalar": round(shape.softmax_scale ** -2),  # an int field
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False}


def weights(shape) -> Table:
    return decoder(shape, ATTENTION, QK_NORM, NORMS, DENSE_MLP)


def problems(shape, cfg) -> list[str]:
    """What megatron-core's GPTModel (with toolkit.mcore.layers) would compute differently."""
    out = [f"{name}={getattr(cfg, name)}: megatron-core has no {what}"
           for name, what in (("final_logit_softcapping", "soft-capping of the logits"),
                              ("attn_logit_softcapping", "soft-capping of the attention scores"))
           if getattr(cfg, name, None) is not None]
    if getattr(cfg, "use_bidirectional_attention", False):
        out.append("use_bidirectional_attention=true: megatron-core's GPT attention is causal")
    rope_local = _rope(cfg)[1]
    if rope_local.get("rope_type", "default") != "default":
        out.append(f"rope_parameters.{SLIDING}.rope_type='{rope_local['rope_type']}': the toolkit's local rope is "
                   "unscaled")
    return out


GEMMA3_TINY = {  # layers 1, 2 and 4 sliding, 3 global (the pattern does not divide the layers, as in Gemma-3-1B)
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-06, "hidden_activation": ACTIVATION, "tie_word_embeddings": True, "bos_token_id": 2,
    "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "float32", "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text", "query_pre_attn_scalar": 24, "sliding_window": 16, "sliding_window_pattern": 3,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "attention_bias": False, "final_logit_softcapping": None, "attn_logit_softcapping": None
}

register(Family("gemma3_text", ("Gemma3ForCausalLM",), from_hf, to_hf, weights, problems=problems,
                tiny={"gemma3-tiny": GEMMA3_TINY}))
