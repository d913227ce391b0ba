"""DeepSeek-V2 / V3: multi-latent attention, dense first layers, routed + shared experts,
group-limited routing; V3 scores with a sigmoid and balances with an expert bias.

The shape says what transformers computes (its DeepseekV2/V3 modules are the reference the
converters are checked against), which is not always what the config's fields suggest:
  - layer i is a MoE layer when i >= first_k_dense_replace (``moe_layer_freq`` is ignored);
  - V2 scores with a softmax over all experts and never renormalises the top-k weights
    (megatron's ``moe_router_pre_softmax``), whatever ``norm_topk_prob`` says; its groups
    only count with ``topk_method='group_limited_greedy'``;
  - V3 always scores with a sigmoid, adds ``e_score_correction_bias`` before choosing
    (megatron's expert bias) and limits the groups when ``n_group`` > 1.
What megatron-core cannot reproduce is refused by the converters
(converters/families/deepseek.py), not hidden here.
"""
from __future__ import annotations

from ._common import check_act, rope
from .registry import register_family
from .shape import MLAShape, ModelShape, MoEShape


def _groups(cfg, limited: bool) -> dict:
    n = cfg.n_group or 1
    return dict(num_groups=n, group_topk=cfg.topk_group) if limited and n > 1 else {}


def _moe(cfg, v3: bool) -> MoEShape:
    limited = v3 or cfg.topk_method == "group_limited_greedy"
    return MoEShape(
        num_experts=cfg.n_routed_experts,
        topk=cfg.num_experts_per_tok,
        ffn_hidden_size=cfg.moe_intermediate_size,
        layers=tuple(i >= cfg.first_k_dense_replace for i in range(cfg.num_hidden_layers)),
        shared_ffn_hidden_size=(cfg.n_shared_experts or 0) * cfg.moe_intermediate_size,
        score_function="sigmoid" if v3 else "softmax",
        pre_softmax=not v3,
        topk_scaling_factor=cfg.routed_scaling_factor,
        expert_bias=v3,
        aux_loss_coeff=getattr(cfg, "aux_loss_alpha", 0.0) or 0.0,
        **_groups(cfg, limited),
    )


def _from_hf(cfg, arch: str) -> ModelShape:
    check_act(cfg)
    theta, scaling = rope(cfg)
    mla = MLAShape(cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                   cfg.v_head_dim)
    return ModelShape(
        architecture=arch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_attention_heads, head_dim=cfg.v_head_dim,  # megatron: kv_channels = v_head_dim
        ffn_hidden_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=theta, rope_scaling=scaling, norm_eps=cfg.rms_norm_eps,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), attention_dropout=float(cfg.attention_dropout),
        qk_norm=True,  # megatron's qk_layernorm: the q / kv latent RMSNorms (without it they vanish)
        moe=_moe(cfg, arch == "DeepseekV3ForCausalLM"), mla=mla)


def _to_hf(shape: ModelShape, model_type: str) -> dict:
    m, a = shape.moe, shape.mla
    rope_parameters = {**(shape.rope_scaling or {"rope_type": "default"}), "rope_theta": shape.rope_theta}
    d = dict(
        architectures=[shape.architecture], model_type=model_type, vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size, intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads, max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.norm_eps, tie_word_embeddings=shape.tie_embeddings, rope_parameters=rope_parameters,
        q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, n_routed_experts=m.num_experts,
        num_experts_per_tok=m.topk, moe_intermediate_size=m.ffn_hidden_size,
        n_shared_experts=m.shared_ffn_hidden_size // m.ffn_hidden_size,
        first_k_dense_replace=m.layers.index(True) if any(m.layers) else shape.num_layers,
        n_group=m.num_groups or 1, topk_group=m.group_topk or 1,
        routed_scaling_factor=m.topk_scaling_factor or 1.0, norm_topk_prob=True,
        aux_loss_alpha=m.aux_loss_coeff, hidden_act="silu", attention_dropout=shape.attention_dropout)
    if model_type == "deepseek_v2":
        d.update(topk_method="group_limited_greedy" if m.num_groups else "greedy", norm_topk_prob=False)
    else:
        d.update(topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True,
                 num_nextn_predict_layers=shape.mtp_layers)
    return d


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
