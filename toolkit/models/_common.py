"""Fields every supported family shares (Llama-style decoder: RMSNorm, SwiGLU, RoPE)."""
from __future__ import annotations

from typing import Any

from ..errors import SpecError


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


def check_act(cfg) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise SpecError(f"hidden_act='{act}' is not supported (SwiGLU with silu only)")


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
