"""megatron-core's own facts about a model: the architecture fields of its TransformerConfig, what
its rope implementations can express (and what Megatron-LM's flags can), the padded vocabulary,
and how the JSON form of a TransformerConfig becomes the object. The planner's rules, the
emitters, the converters and the runtime read them from here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..models import ModelShape

VOCAB_DIVISOR = 128  # Megatron-LM's default --make-vocab-size-divisible-by

# ModelShape features -> the TransformerConfig fields that build them (what megatron-core has)
NORMS = {"rmsnorm": "RMSNorm"}
ACTIVATIONS = {"swiglu": {"gated_linear_unit": True, "activation_func": "silu"},
               "geglu_tanh": {"gated_linear_unit": True, "activation_func": "gelu_tanh"},
               "quick_geglu": {"gated_linear_unit": True, "activation_func": "quick_gelu"}}
# activation_func names (JSON) that are not torch.nn.functional's own: transformers' gelu_pytorch_tanh
ACTIVATION_FUNCS = {"gelu_tanh": ("gelu", {"approximate": "tanh"})}
# activation_func names that are megatron-core's own functions, not torch.nn.functional's (the one
# TransformerConfig compares against when it checks glu_linear_offset with fused activations)
MEGATRON_ACTIVATIONS = {"quick_gelu": ("megatron.core.fusions.fused_bias_geglu", "quick_gelu")}


def feature_problems(shape: ModelShape) -> list[str]:
    """Features of the model megatron-core's GPTModel (as the toolkit configures it) does not build."""
    out = [f"{name}='{value}' is not one megatron-core builds here (known: {', '.join(known)})"
           for name, value, known in (("norm", shape.norm, NORMS), ("activation", shape.activation, ACTIVATIONS))
           if value not in known]
    if not 0 < shape.rotary_fraction <= 1:
        out.append(f"rotary_fraction={shape.rotary_fraction} is not in (0, 1]")
    return out


def own_layer_features(shape: ModelShape) -> list[str]:
    """The shape's features megatron-core's GPT layer specs do not build and the toolkit's own
    modules do (toolkit.mcore.layers, put in by toolkit.mcore.model): Gemma 3's."""
    return [name for name, value in (("zero_centered_norm", shape.zero_centered_norm), ("post_norms", shape.post_norms),
                                     ("embedding_scale", shape.embedding_scale is not None),
                                     ("local_rope_theta", shape.local_rope_theta is not None)) if value]


# megatron-core's llama3 rope scaling (RotaryEmbedding._apply_scaling) fixes these values.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_problem(shape: ModelShape) -> str | None:
    """Why megatron-core cannot reproduce this model's rope scaling, or None."""
    r = shape.rope_scaling
    if not r:
        return None
    kind = r.get("rope_type", r.get("type"))
    if kind == "llama3":
        bad = {k: r.get(k) for k, v in MEGATRON_LLAMA3_ROPE.items() if float(r.get(k, v)) != v}
        if bad:
            return (f"rope_scaling {bad} cannot be expressed in megatron-core, whose llama3 scaling fixes "
                    f"{MEGATRON_LLAMA3_ROPE}")
        return None
    if kind == "yarn" and shape.mla is not None:
        return None
    if kind == "linear":  # positions / factor: megatron's seq_len_interpolation_factor
        return None
    if kind == "yarn":  # GPTModel's YarnRotaryEmbedding: the concentration factor from factor alone
        bad = sorted(k for k in ("attention_factor", "mscale", "mscale_all_dim") if r.get(k) is not None)
        return (f"rope_scaling {bad} of yarn: megatron-core's GPTModel derives the attention scaling from the factor "
                "alone") if bad else None
    return f"rope_scaling type '{kind}' is not supported for {shape.architecture} by megatron-core's GPTModel"


def model_fields(shape: ModelShape) -> dict[str, Any]:
    """Architecture-only TransformerConfig fields (no parallelism, no precision)."""
    d: dict[str, Any] = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_hidden_size,
        normalization=NORMS[shape.norm], layernorm_epsilon=shape.norm_eps, **ACTIVATIONS[shape.activation],
        add_bias_linear=shape.linear_bias, add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm, attention_dropout=shape.attention_dropout,
        **_glu_fields(shape), **({"softmax_type": "learnable"} if shape.attention_sinks else {}),
        # megatron's hidden_dropout is the residual (and embedding) dropout, which none of the HF
        # decoders here has (their only dropout is attention's): 0, not Megatron-LM's default 0.1
        hidden_dropout=0.0,
    )
    if shape.zero_centered_norm:
        d["layernorm_zero_centered_gamma"] = True
    if shape.attention_output_gate:
        d["attention_output_gate"] = True
    if shape.linear_attention is not None:
        d.update(linear_attention_fields(shape))
    if shape.softmax_scale is not None:
        d["softmax_scale"] = shape.softmax_scale
    if shape.moe is not None:
        d.update(_moe_fields(shape))
    if shape.mla is not None:
        d.update(_mla_fields(shape))
    elif _yarn(shape):
        d.update(yarn_fields(shape))
    return d


def linear_attention_fields(shape: ModelShape) -> dict[str, Any]:
    """megatron-core's gated delta net layers: the list form of linear_attention_freq (1 = gated
    delta net, 0 = softmax attention, layer by layer) and the heads' sizes."""
    la = shape.linear_attention
    return dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=[int(x) for x in la.layers],
                linear_conv_kernel_dim=la.conv_kernel, linear_key_head_dim=la.key_head_dim,
                linear_value_head_dim=la.value_head_dim, linear_num_key_heads=la.key_heads,
                linear_num_value_heads=la.value_heads)


def _glu_fields(shape: ModelShape) -> dict[str, Any]:
    d: dict[str, Any] = {}
    if shape.glu_clamp is not None:
        d["activation_func_clamp_value"] = shape.glu_clamp
    if shape.glu_linear_offset:
        d["glu_linear_offset"] = shape.glu_linear_offset
    return d


def _yarn(shape: ModelShape) -> bool:
    r = shape.rope_scaling or {}
    return r.get("rope_type", r.get("type")) == "yarn"


# GPTModel(position_embedding_type="yarn") reads these from its config with getattr (Megatron-LM
# sets them on the config; TransformerConfig has no such fields): load_transformer_config sets them
YARN_ATTRIBUTES = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                   "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")


def yarn_fields(shape: ModelShape) -> dict[str, Any]:
    """Yarn rope of a non-MLA model, as GPTModel's YarnRotaryEmbedding takes it: transformers'
    ``truncate`` (default true) is megatron's rounding of the correction range to integers, and
    mscale 1 / mscale_all_dim 0 give transformers' default attention factor 0.1 ln(factor) + 1."""
    r = shape.rope_scaling
    return dict(zip(YARN_ATTRIBUTES, (
        float(r["factor"]), int(r["original_max_position_embeddings"]), float(r.get("beta_fast") or 32),
        float(r.get("beta_slow") or 1), 1.0, 0.0, bool(r.get("truncate", True)))))


def _moe_fields(shape: ModelShape) -> dict[str, Any]:
    m = shape.moe
    d: dict[str, Any] = dict(
        num_moe_experts=m.num_experts, moe_router_topk=m.topk, moe_ffn_hidden_size=m.ffn_hidden_size,
        moe_layer_freq=[int(x) for x in m.layers], moe_router_pre_softmax=m.pre_softmax,
        moe_router_score_function=m.score_function, moe_router_enable_expert_bias=m.expert_bias,
    )
    if m.shared_ffn_hidden_size:
        d.update(moe_shared_expert_intermediate_size=m.shared_ffn_hidden_size,
                 moe_shared_expert_gate=m.shared_expert_gate)
    if m.topk_scaling_factor and m.topk_scaling_factor != 1.0:
        d["moe_router_topk_scaling_factor"] = m.topk_scaling_factor
    if m.num_groups:
        d.update(moe_router_num_groups=m.num_groups, moe_router_group_topk=m.group_topk)
    return d


def _mla_fields(shape: ModelShape) -> dict[str, Any]:
    m, r = shape.mla, shape.rope_scaling or {}
    d: dict[str, Any] = dict(
        multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim, qk_pos_emb_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
        rotary_base=shape.rope_theta, rope_type="yarn" if r else "rope",
    )
    if r:
        d.update(rotary_scaling_factor=float(r["factor"]),
                 original_max_position_embeddings=int(r["original_max_position_embeddings"]),
                 beta_fast=float(r.get("beta_fast", 32)), beta_slow=float(r.get("beta_slow", 1)),
                 mscale=float(r.get("mscale", 1.0)), mscale_all_dim=float(r.get("mscale_all_dim", 0.0)))
    return d


# MLATransformerConfig defaults of the yarn fields Megatron-LM 0.16's parser cannot set
MEGATRON_LM_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096}


def megatron_lm_problem(shape: ModelShape) -> str | None:
    """Why Megatron-LM's flags cannot express this model (the yarn settings it has no flag for), or None."""
    own = [f for f in own_layer_features(shape) if f != "zero_centered_norm"]  # that one is --apply-layernorm-1p
    if own:
        return (f"{', '.join(own)}: Megatron-LM's GPT model has no flags for these (the toolkit's runtime builds "
                "them with its own layer spec, toolkit.mcore.layers)")
    if shape.mla is None:
        return _flagless_features(shape)
    fields = _mla_fields(shape)
    bad = {k: fields[k] for k, v in MEGATRON_LM_YARN_DEFAULTS.items() if k in fields and float(fields[k]) != v}
    if bad:
        return (f"rope scaling {bad}: Megatron-LM 0.16 has no flags for these yarn settings and uses "
                f"{MEGATRON_LM_YARN_DEFAULTS}")
    return None


def _flagless_features(shape: ModelShape) -> str | None:
    """Features the toolkit's Megatron-LM flags (megatron_lm_args: --swiglu, --disable-bias-linear,
    rope) do not write: named, so no command silently trains another model. Yarn rope outside
    multi-latent attention (GPT-OSS) is one Megatron-LM core_v0.16.1 itself cannot run: its
    --position-embedding-type choices have no 'yarn', and --rope-type yarn asserts
    --multi-latent-attention (megatron/training/arguments.py); its other features have flags there
    (--softmax-type learnable, --window-attn-skip-freq, --quick-geglu, --activation-func-clamp-value,
    --glu-linear-offset) that are not written here while the model cannot run anyway."""
    if _yarn(shape):
        return ("yarn rope outside multi-latent attention: Megatron-LM core_v0.16.1 cannot run it "
                "(--position-embedding-type has no 'yarn'; --rope-type yarn asserts --multi-latent-attention)")
    found = [name for name, on in (("attention sinks", shape.attention_sinks),
                                   (f"activation '{shape.activation}'", shape.activation != "swiglu"),
                                   ("linear biases", shape.linear_bias),
                                   ("per-layer sliding window", shape.window_layers is not None),
                                   ("clamped GLU", shape.glu_clamp is not None or bool(shape.glu_linear_offset)))
             if on]
    return f"the Megatron-LM flags written here do not express {', '.join(found)}" if found else None


def padded_vocab(vocab: int, tp: int, divisible_by: int = VOCAB_DIVISOR) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by * tp."""
    m = divisible_by * tp
    return -(-vocab // m) * m




def load_transformer_config(kwargs: dict[str, Any] | str | Path, **overrides: Any):
    """Build megatron-core's TransformerConfig (MLATransformerConfig for MLA) from the JSON."""
    import torch
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    d = json.loads(Path(kwargs).read_text()) if isinstance(kwargs, (str, Path)) else dict(kwargs)
    d.update(overrides)
    for k in ("params_dtype", "pipeline_dtype"):
        if isinstance(d.get(k), str):
            d[k] = getattr(torch, d[k])
    if isinstance(d.get("activation_func"), str):
        d["activation_func"] = activation_func(d["activation_func"])
    if isinstance(d.get("window_size"), list):
        d["window_size"] = tuple(d["window_size"])
    if isinstance(d.get("attention_backend"), str):
        from megatron.core.transformer.enums import AttnBackend

        d["attention_backend"] = AttnBackend[d["attention_backend"]]
    cls = MLATransformerConfig if d.get("multi_latent_attention") else TransformerConfig
    yarn = {k: d.pop(k) for k in YARN_ATTRIBUTES if k in d}
    config = cls(**d)
    for k, v in yarn.items():
        setattr(config, k, v)
    return config


def activation_func(name: str):
    """The function an activation_func name stands for: megatron-core's own (``quick_gelu``), a
    torch.nn.functional one with arguments (``gelu_tanh``: F.gelu with the tanh approximation,
    transformers' gelu_pytorch_tanh), or torch.nn.functional's of that name."""
    import functools
    import importlib

    import torch.nn.functional as F

    if name in MEGATRON_ACTIVATIONS:
        module, attr = MEGATRON_ACTIVATIONS[name]
        return getattr(importlib.import_module(module), attr)
    base, kwargs = ACTIVATION_FUNCS.get(name, (name, {}))
    return functools.partial(getattr(F, base), **kwargs) if kwargs else getattr(F, base)
