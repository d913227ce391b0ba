"""DeepSeek-V2 / V3: multi-latent attention, dense first layers, routed + shared experts,
group-limited routing; V3 scores with a sigmoid and balances with an expert bias."""
from __future__ import annotations

from ._common import check_act, rope
from .registry import register_family
from .shape import MLAShape, ModelShape, MoEShape


def _moe(cfg) -> MoEShape:
    sigmoid = getattr(cfg, "scoring_func", "softmax") == "sigmoid"
    groups = getattr(cfg, "n_group", None)
    return MoEShape(
        num_experts=cfg.n_routed_experts,
        topk=cfg.num_experts_per_tok,
        ffn_hidden_size=cfg.moe_intermediate_size,
        layers=tuple(i >= cfg.first_k_dense_replace and i % cfg.moe_layer_freq == 0
                     for i in range(cfg.num_hidden_layers)),
        shared_ffn_hidden_size=(cfg.n_shared_experts or 0) * cfg.moe_intermediate_size,
        score_function="sigmoid" if sigmoid else "softmax",
        pre_softmax=not sigmoid and not cfg.norm_topk_prob,
        topk_scaling_factor=cfg.routed_scaling_factor,
        num_groups=groups if groups and groups > 1 else None,
        group_topk=cfg.topk_group if groups and groups > 1 else None,
        expert_bias=getattr(cfg, "topk_method", "") == "noaux_tc",
        aux_loss_coeff=getattr(cfg, "aux_loss_alpha", 0.0) or 0.0,
    )


def _from_hf(cfg, arch: str) -> ModelShape:
    check_act(cfg)
    theta, scaling = rope(cfg)
    mla = MLAShape(cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                   cfg.v_head_dim)
    return ModelShape(
        architecture=arch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_attention_heads, head_dim=cfg.v_head_dim,
        ffn_hidden_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=theta, rope_scaling=scaling, norm_eps=cfg.rms_norm_eps,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), moe=_moe(cfg), mla=mla)


def _to_hf(shape: ModelShape, model_type: str) -> dict:
    m, a = shape.moe, shape.mla
    rope_parameters = {**(shape.rope_scaling or {"rope_type": "default"}), "rope_theta": shape.rope_theta}
    return dict(
        architectures=[shape.architecture], model_type=model_type, vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size, intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads, max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.norm_eps, tie_word_embeddings=shape.tie_embeddings, rope_parameters=rope_parameters,
        q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, n_routed_experts=m.num_experts,
        num_experts_per_tok=m.topk, moe_intermediate_size=m.ffn_hidden_size,
        n_shared_experts=m.shared_ffn_hidden_size // m.ffn_hidden_size,
        first_k_dense_replace=m.layers.index(True), moe_layer_freq=1,
        n_group=m.num_groups or 1, topk_group=m.group_topk or 1,
        routed_scaling_factor=m.topk_scaling_factor or 1.0, norm_topk_prob=not m.pre_softmax,
        scoring_func=m.score_function, topk_method="noaux_tc" if m.expert_bias else "greedy",
        aux_loss_alpha=m.aux_loss_coeff,
        hidden_act="silu")


@register_family("deepseek_v2", "DeepseekV2ForCausalLM")
class DeepseekV2:
    @staticmethod
    def from_hf(cfg) -> ModelShape:
        return _from_hf(cfg, "DeepseekV2ForCausalLM")

    @staticmethod
    def to_hf(shape: ModelShape) -> dict:
        return _to_hf(shape, "deepseek_v2")


@register_family("deepseek_v3", "DeepseekV3ForCausalLM")
class DeepseekV3:
    @staticmethod
    def from_hf(cfg) -> ModelShape:
        return _from_hf(cfg, "DeepseekV3ForCausalLM")

    @staticmethod
    def to_hf(shape: ModelShape) -> dict:
        return _to_hf(shape, "deepseek_v3")
