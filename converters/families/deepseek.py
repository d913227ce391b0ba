"""DeepSeek-V2 (incl. V2-Lite: no q LoRA) and DeepSeek-V3: multi-latent attention, dense
first layers, routed experts + shared experts, V3's expert bias and MTP modules.

Megatron (local spec, ``qk_layernorm=True``) <- HF. MTP module k is HF layer
``num_hidden_layers + k`` (megatron-core 0.16: ``mtp.layers.k``; its decoder layer
``mtp.layers.k.transformer_layer.*`` is the decoder table's, added by families.expand);
its ``embed_tokens`` and ``shared_head.head`` are the main model's embedding and head,
which megatron shares: they are aliases (checked equal on import, written on export).
"""
from __future__ import annotations

from ..dtypes import float32
from ..fused import MOE, Column, Gated, Replicated, Row
from . import Table, conversion_problems, hf_aliases, weight_table, without_output_when_tied
from .llama import DENSE_MLP, EMBEDDING, HEAD, PRE_MLP_NORM
from .qwen2_moe import ROUTED

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

SHARED_EXPERTS: Table = {
    "decoder.layers.{}.mlp.shared_experts.linear_fc1.weight": Gated((
        "model.layers.{}.mlp.shared_experts.gate_proj.weight", "model.layers.{}.mlp.shared_experts.up_proj.weight"),
        ffn="shared_ffn", scope=MOE),
    "decoder.layers.{}.mlp.shared_experts.linear_fc2.weight": Row(
        "model.layers.{}.mlp.shared_experts.down_proj.weight", dims=("hidden", "shared_ffn"), scope=MOE),
}

EXPERT_BIAS: Table = {  # fp32 in transformers (_keep_in_fp32_modules_strict) and in megatron's router
    "decoder.layers.{}.mlp.router.expert_bias": Replicated("model.layers.{}.mlp.gate.e_score_correction_bias",
                                                           dims=("experts",), scope=MOE, keep_dtype=float32),
}

MTP: Table = {  # "{}" = k on the megatron side, num_hidden_layers + k on the HF side
    "mtp.layers.{}.enorm.weight": Replicated("model.layers.{}.enorm.weight"),
    "mtp.layers.{}.hnorm.weight": Replicated("model.layers.{}.hnorm.weight"),
    "mtp.layers.{}.eh_proj.weight": Column("model.layers.{}.eh_proj.weight", dims=("hidden", "hidden2")),
    "mtp.layers.{}.final_layernorm.weight": Replicated("model.layers.{}.shared_head.norm.weight"),
}

MTP_ALIASES = {"model.layers.{}.embed_tokens.weight": "model.embed_tokens.weight",
               "model.layers.{}.shared_head.head.weight": "lm_head.weight"}


@weight_table("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
def deepseek(shape) -> Table:
    q = Q_DIRECT if shape.mla.q_lora_rank is None else Q_LORA
    bias = EXPERT_BIAS if shape.moe.expert_bias else {}
    shared = SHARED_EXPERTS if shape.moe.shared_ffn_hidden_size else {}
    return without_output_when_tied(shape, {**EMBEDDING, **MLA, **q, **PRE_MLP_NORM, **DENSE_MLP, **ROUTED, **bias,
                                            **shared, **HEAD, **MTP})


@hf_aliases("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
def deepseek_aliases(shape) -> dict[str, str]:
    return {alias.format(shape.num_layers + k): of
            for k in range(shape.mtp_layers) for alias, of in MTP_ALIASES.items()}


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


@conversion_problems("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
def deepseek_problems(shape, cfg) -> list[str]:
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
