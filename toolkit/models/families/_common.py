"""What the Llama-style decoders share (RMSNorm, SwiGLU, RoPE): the config.json fields and the
weight tables of their embedding, attention, MLP and head, which each family's table extends.
Megatron (local spec) <- HF; order = megatron-core's module order (state_dict order)."""
from __future__ import annotations

from typing import Any

from ...errors import SpecError
from ..weights import DENSE, MOE, QKV, Column, Gated, Replicated, Row, Table, Vocab


def rope(cfg) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers' normalised ``rope_parameters``.

    transformers 5 moved rope_theta into rope_parameters; reading ``cfg.rope_theta`` with a
    default would silently give the wrong base, so it is read from there only.
    """
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        raise SpecError(f"{cfg.config_class} has no rope_parameters.rope_theta")
    theta = float(params.pop("rope_theta"))
    kind = params.get("rope_type", "default")
    return theta, (None if kind == "default" else params)


def partial_rotary(cfg, default: float) -> float:
    """The share of each head's dims rope rotates: ``rope_parameters.partial_rotary_factor``, the
    top-level field, else the config class's own default (GLM-4.5 0.5, Qwen3-Next 0.25, set in
    their ``__post_init__``, so not among the class's field defaults)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    return float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or default))


def check_act(cfg) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise SpecError(f"hidden_act='{act}' is not supported (SwiGLU with silu only)")


SWIGLU = "swiglu"  # ModelShape.activation of a gated MLP with silu: hidden_act 'silu' in these configs


def dense_fields(cfg) -> dict[str, Any]:
    """ModelShape keyword arguments common to all families."""
    check_act(cfg)
    theta, scaling = rope(cfg)
    heads = cfg.num_attention_heads
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_attention_heads=heads,
        num_query_groups=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        ffn_hidden_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=cfg.rms_norm_eps,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_dropout=float(cfg.attention_dropout),
    )


def dense_hf(shape, model_type: str) -> dict[str, Any]:
    """config.json fields common to all families (inverse of dense_fields)."""
    rope_parameters = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope_scaling:
        rope_parameters = {**shape.rope_scaling, "rope_theta": shape.rope_theta}
    return dict(
        architectures=[shape.architecture],
        model_type=model_type,
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_query_groups,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.norm_eps,
        tie_word_embeddings=shape.tie_embeddings,
        rope_parameters=rope_parameters,
        hidden_act="silu",
        attention_dropout=shape.attention_dropout,
    )


SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


def typed_layers(cfg, every: int, kind: str) -> tuple[bool, ...]:
    """Per decoder layer, whether it is of ``kind`` (transformers' layer_types word for the layers
    that are not full attention): the config's ``layer_types``, else every `every`-th layer full
    and the others ``kind``."""
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None) or [kind if (i + 1) % every else FULL for i in range(n)]
    unknown = sorted(set(types) - {kind, FULL})
    if unknown or len(types) != n:
        raise SpecError(f"layer_types: {len(types)} entries for {n} layers"
                        + (f", unknown {unknown} (known: '{kind}', '{FULL}')" if unknown else ""))
    return tuple(t == kind for t in types)


def window_layers(cfg, every: int) -> tuple[bool, ...]:
    """Per decoder layer, whether its attention is sliding-window (Gemma 3's
    sliding_window_pattern; GPT-OSS alternates, 2)."""
    return typed_layers(cfg, every, SLIDING)


def layer_types(windows: tuple[bool, ...]) -> list[str]:
    """transformers' layer_types of a per-layer sliding-window pattern."""
    return [SLIDING if w else FULL for w in windows]


def moe_layers(num_layers: int, step: int, dense_only: list[int]) -> tuple[bool, ...]:
    """Qwen2/3-MoE: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and not in mlp_only_layers."""
    return tuple((i + 1) % step == 0 and i not in dense_only for i in range(num_layers))


def sparse_step(layers: tuple[bool, ...]) -> int:
    """Smallest step whose pattern covers every sparse layer (the rest go to mlp_only_layers)."""
    for step in range(1, len(layers) + 1):
        if all((i + 1) % step == 0 for i, s in enumerate(layers) if s):
            return step
    return 1


EMBEDDING: Table = {"embedding.word_embeddings.weight": Vocab("model.embed_tokens.weight")}

ATTENTION: Table = {
    "decoder.layers.{}.input_layernorm.weight": Replicated("model.layers.{}.input_layernorm.weight"),
    "decoder.layers.{}.self_attention.linear_proj.weight": Row("model.layers.{}.self_attn.o_proj.weight",
                                                               dims=("hidden", "q")),
    "decoder.layers.{}.self_attention.linear_qkv.weight": QKV((
        "model.layers.{}.self_attn.q_proj.weight", "model.layers.{}.self_attn.k_proj.weight",
        "model.layers.{}.self_attn.v_proj.weight")),
}

QKV_BIAS: Table = {  # q/k/v biases, fused like the weights
    "decoder.layers.{}.self_attention.linear_qkv.bias": QKV((
        "model.layers.{}.self_attn.q_proj.bias", "model.layers.{}.self_attn.k_proj.bias",
        "model.layers.{}.self_attn.v_proj.bias")),
}

QK_NORM: Table = {  # per-head q/k RMSNorm (megatron's q_layernorm / k_layernorm)
    "decoder.layers.{}.self_attention.q_layernorm.weight": Replicated("model.layers.{}.self_attn.q_norm.weight",
                                                                      dims=("head_dim",)),
    "decoder.layers.{}.self_attention.k_layernorm.weight": Replicated("model.layers.{}.self_attn.k_norm.weight",
                                                                      dims=("head_dim",)),
}

PRE_MLP_NORM: Table = {
    "decoder.layers.{}.pre_mlp_layernorm.weight": Replicated("model.layers.{}.post_attention_layernorm.weight"),
}

DENSE_MLP: Table = {
    "decoder.layers.{}.mlp.linear_fc1.weight": Gated(("model.layers.{}.mlp.gate_proj.weight",
                                                      "model.layers.{}.mlp.up_proj.weight"), scope=DENSE),
    "decoder.layers.{}.mlp.linear_fc2.weight": Row("model.layers.{}.mlp.down_proj.weight", scope=DENSE),
}

ROUTED: Table = {  # routed experts named model.layers.L.mlp.experts.E.* (Qwen-MoE, DeepSeek)
    "decoder.layers.{}.mlp.router.weight": Replicated("model.layers.{}.mlp.gate.weight", dims=("experts", "hidden"),
                                                      scope=MOE),
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight": Gated((
        "model.layers.{}.mlp.experts.{}.gate_proj.weight", "model.layers.{}.mlp.experts.{}.up_proj.weight"),
        ffn="expert_ffn", scope=MOE),
    "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight": Row(
        "model.layers.{}.mlp.experts.{}.down_proj.weight", dims=("hidden", "expert_ffn"), scope=MOE),
}

# DeepSeek-style routed-MoE extras (DeepSeek-V2/V3, GLM-4.5): shared experts named
# model.layers.L.mlp.shared_experts.*, and the aux-loss-free expert bias of a sigmoid router
SHARED_EXPERTS: Table = {
    "decoder.layers.{}.mlp.shared_experts.linear_fc1.weight": Gated((
        "model.layers.{}.mlp.shared_experts.gate_proj.weight", "model.layers.{}.mlp.shared_experts.up_proj.weight"),
        ffn="shared_ffn", scope=MOE),
    "decoder.layers.{}.mlp.shared_experts.linear_fc2.weight": Row(
        "model.layers.{}.mlp.shared_experts.down_proj.weight", dims=("hidden", "shared_ffn"), scope=MOE),
}

GATED_SHARED_EXPERT: Table = {  # Qwen2-MoE / Qwen3-Next: one shared expert behind sigmoid(x . gate)
    "decoder.layers.{}.mlp.shared_experts.gate_weight": Replicated("model.layers.{}.mlp.shared_expert_gate.weight",
                                                                   dims=(1, "hidden"), scope=MOE),
    "decoder.layers.{}.mlp.shared_experts.linear_fc1.weight": Gated((
        "model.layers.{}.mlp.shared_expert.gate_proj.weight", "model.layers.{}.mlp.shared_expert.up_proj.weight"),
        ffn="shared_ffn", scope=MOE),
    "decoder.layers.{}.mlp.shared_experts.linear_fc2.weight": Row(
        "model.layers.{}.mlp.shared_expert.down_proj.weight", dims=("hidden", "shared_ffn"), scope=MOE),
}

EXPERT_BIAS: Table = {  # fp32 in transformers (_keep_in_fp32_modules_strict) and in megatron's router
    "decoder.layers.{}.mlp.router.expert_bias": Replicated("model.layers.{}.mlp.gate.e_score_correction_bias",
                                                           dims=("experts",), scope=MOE, keep_dtype="float32"),
}

# Multi-token prediction modules as DeepSeek-V3's checkpoint holds them (GLM-4.5's alike): HF
# layer num_hidden_layers + k (see toolkit.models.weights for the decoder layer they hold)
MTP: Table = {  # "{}" = k on the megatron side, num_hidden_layers + k on the HF side
    "mtp.layers.{}.enorm.weight": Replicated("model.layers.{}.enorm.weight"),
    "mtp.layers.{}.hnorm.weight": Replicated("model.layers.{}.hnorm.weight"),
    "mtp.layers.{}.eh_proj.weight": Column("model.layers.{}.eh_proj.weight", dims=("hidden", "hidden2")),
    "mtp.layers.{}.final_layernorm.weight": Replicated("model.layers.{}.shared_head.norm.weight"),
}

MTP_ALIASES = {"model.layers.{}.embed_tokens.weight": "model.embed_tokens.weight",
               "model.layers.{}.shared_head.head.weight": "lm_head.weight"}


HEAD: Table = {
    "decoder.final_layernorm.weight": Replicated("model.norm.weight"),
    "output_layer.weight": Vocab("lm_head.weight"),
}


def without_output_when_tied(shape, table: Table) -> Table:
    """Tied embeddings: no output_layer (megatron reuses the embedding; HF has no lm_head)."""
    return {k: v for k, v in table.items() if not (shape.tie_embeddings and k == "output_layer.weight")}


def decoder(shape, *parts: Table) -> Table:
    """A Llama-style decoder's table: embedding, the given layer parts, head (no output layer when tied)."""
    table: Table = dict(EMBEDDING)
    for part in parts:
        table.update(part)
    return without_output_when_tied(shape, {**table, **HEAD})


def mtp_aliases(shape) -> dict[str, str]:
    """An MTP module's embed_tokens and shared_head.head: copies of the main model's (megatron shares them)."""
    return {alias.format(shape.num_layers + k): of
            for k in range(shape.mtp_layers) for alias, of in MTP_ALIASES.items()}
