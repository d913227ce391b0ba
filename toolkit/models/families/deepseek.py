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
What megatron-core cannot reproduce is refused (``problems``), not hidden in the shape.

Weights: megatron (local spec, ``qk_layernorm=True``) <- HF. MTP module k is HF layer
``num_hidden_layers + k`` (megatron-core 0.16: ``mtp.layers.k``; its decoder layer
``mtp.layers.k.transformer_layer.*`` is the decoder table's, added by weights.expand); its
``embed_tokens`` and ``shared_head.head`` are the main model's embedding and head, which
megatron shares: they are aliases (checked equal on import, written on export).
"""
from __future__ import annotations

from ..family import Family, register
from ..shape import MLAShape, ModelShape, MoEShape
from ..weights import Column, Replicated, Row, Table
from ._common import (
    DENSE_MLP,
    EXPERT_BIAS,
    MTP,
    PRE_MLP_NORM,
    ROUTED,
    SHARED_EXPERTS,
    check_act,
    decoder,
    mtp_aliases,
    rope,
)

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepseekV2/V3RMSNorm(dim) built without an eps
ATTN = "decoder.layers.{}.self_attention."
HF_ATTN = "model.layers.{}.self_attn."

MLA: Table = {
    "decoder.layers.{}.input_layernorm.weight": Replicated("model.layers.{}.input_layernorm.weight"),
    ATTN + "linear_proj.weight": Row(HF_ATTN + "o_proj.weight", dims=("hidden", "v_heads")),
    ATTN + "linear_kv_down_proj.weight": Column(HF_ATTN + "kv_a_proj_with_mqa.weight", dims=("kv_lora_rope", "hidden")),
    ATTN + "linear_kv_up_proj.weight": Column(HF_ATTN + "kv_b_proj.weight", dims=("kv_heads", "kv_lora")),
    ATTN + "kv_layernorm.weight": Replicated(HF_ATTN + "kv_a_layernorm.weight", dims=("kv_lora",)),
}

Q_LORA: Table = {
    ATTN + "linear_q_down_proj.weight": Column(HF_ATTN + "q_a_proj.weight", dims=("q_lora", "hidden")),
    ATTN + "linear_q_up_proj.weight": Column(HF_ATTN + "q_b_proj.weight", dims=("q_heads", "q_lora")),
    ATTN + "q_layernorm.weight": Replicated(HF_ATTN + "q_a_layernorm.weight", dims=("q_lora",)),
}

Q_DIRECT: Table = {  # q_lora_rank null (DeepSeek-V2-Lite)
    ATTN + "linear_q_proj.weight": Column(HF_ATTN + "q_proj.weight", dims=("q_heads", "hidden")),
}

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


def weights(shape) -> Table:
    q = Q_DIRECT if shape.mla.q_lora_rank is None else Q_LORA
    bias = EXPERT_BIAS if shape.moe.expert_bias else {}
    shared = SHARED_EXPERTS if shape.moe.shared_ffn_hidden_size else {}
    return {**decoder(shape, MLA, q, PRE_MLP_NORM, DENSE_MLP, ROUTED, bias, shared), **MTP}


def _routing_problems(shape, cfg, v3: bool) -> list[str]:
    m, out = shape.moe, []
    if not v3 and cfg.topk_method not in ("greedy", "group_limited_greedy"):
        out.append(f"topk_method='{cfg.topk_method}' is not one transformers' DeepseekV2 routes with")
    if v3 and (getattr(cfg, "scoring_func", None) or "sigmoid") != "sigmoid":
        out.append(f"scoring_func='{cfg.scoring_func}': transformers' DeepseekV3 scores with a sigmoid whatever this "
                   "says, DeepSeek's own code would not; the model is ambiguous")
    if v3 and m.topk > 1 and not cfg.norm_topk_prob:
        out.append(f"norm_topk_prob=false with top-{m.topk} sigmoid routing: megatron-core always renormalises the "
                   "chosen sigmoid scores when topk > 1")
    if m.num_groups and m.group_topk < m.num_groups:
        hf_k, mg_k = (2, "top-2 sum") if v3 else (1, "maximum")
        if m.topk // m.group_topk != hf_k:
            out.append(f"group-limited routing (n_group={m.num_groups}, topk_group={m.group_topk}, "
                       f"num_experts_per_tok={m.topk}): megatron-core scores a group by the sum of its top "
                       f"topk // group_topk = {m.topk // m.group_topk} expert scores, transformers' "
                       f"{shape.architecture} by their {mg_k}; tokens would be routed to other experts")
    return out


def _rope_problems(cfg, v3: bool) -> list[str]:
    r, out = dict(cfg.rope_parameters or {}), []
    if v3 and not getattr(cfg, "rope_interleave", True):
        out.append("rope_interleave=false: megatron-core's multi-latent attention rotates interleaved pairs")
    if r.get("rope_type", "default") == "yarn":
        if r.get("factor") is None or r.get("attention_factor") is not None or not r.get("truncate", True):
            out.append(f"yarn settings {r} are not all expressible in megatron-core (it needs 'factor', derives the "
                       "attention factor from mscale / mscale_all_dim and truncates the correction range)")
        elif r.get("mscale") not in (None, 1, 1.0) and not r.get("mscale_all_dim"):
            out.append("yarn mscale without mscale_all_dim: transformers then ignores mscale, megatron-core does not")
    if r.get("partial_rotary_factor", 1.0) != 1.0:
        out.append(f"partial_rotary_factor={r['partial_rotary_factor']} is not supported by megatron-core's MLA")
    return out


def problems(shape, cfg) -> list[str]:
    """What megatron-core's GPTModel (MLA spec) would compute differently from transformers."""
    v3 = shape.architecture == "DeepseekV3ForCausalLM"
    out = [f"{name}=true: megatron-core's multi-latent attention and MLP have no such biases"
           for name in ("attention_bias", "mlp_bias") if getattr(cfg, name, False)]
    if cfg.rms_norm_eps != LATENT_NORM_EPS:
        out.append(f"rms_norm_eps={cfg.rms_norm_eps}: transformers' q/kv latent norms use eps {LATENT_NORM_EPS} "
                   "whatever it says, megatron-core one epsilon for every norm")
    freq = getattr(cfg, "moe_layer_freq", 1)
    if freq not in (None, 1):
        out.append(f"moe_layer_freq={freq}: transformers ignores it (MoE from layer first_k_dense_replace on), "
                   "DeepSeek's own code does not; the model is ambiguous")
    return out + _routing_problems(shape, cfg, v3) + _rope_problems(cfg, v3)


DEEPSEEK_V2_TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "rope_theta": 10000.0, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "scoring_func": "softmax", "topk_method": "greedy", "norm_topk_prob": False,
    "aux_loss_alpha": 0.001
}
DEEPSEEK_V3_TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "rope_theta": 10000.0, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 2, "topk_group": 1,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True
}

# Kimi-K2: DeepSeek-V3's architecture with Kimi's settings (no expert groups, one dense layer,
# routed scaling 2.827, yarn with beta_fast = beta_slow = 1); 12 experts, top-4
KIMI_K2_TINY = {
    **DEEPSEEK_V3_TINY, "n_routed_experts": 12, "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.827, "rope_theta": 50000.0, "num_nextn_predict_layers": 0,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
}

register(Family("deepseek_v2", ("DeepseekV2ForCausalLM",), lambda cfg: _from_hf(cfg, "DeepseekV2ForCausalLM"),
                lambda shape: _to_hf(shape, "deepseek_v2"), weights, mtp_aliases, problems,
                tiny={"deepseek-v2-tiny": DEEPSEEK_V2_TINY}))
register(Family("deepseek_v3", ("DeepseekV3ForCausalLM",), lambda cfg: _from_hf(cfg, "DeepseekV3ForCausalLM"),
                lambda shape: _to_hf(shape, "deepseek_v3"), weights, mtp_aliases, problems,
                tiny={"deepseek-v3-tiny": DEEPSEEK_V3_TINY, "kimi-k2-tiny": KIMI_K2_TINY},
                config_types=("kimi_k2",)))  # Kimi-K2's config.json: DeepSeek's DeepseekV3Config, renamed
