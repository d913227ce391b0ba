"""GLM-4.5 (transformers' Glm4MoeForCausalLM): grouped-query attention with q/k/v biases, an
optional per-head q/k RMSNorm (``use_qk_norm``: GLM-4.5 has it, GLM-4.5-Air not), heads x
head_dim wider than the hidden size, rope on the first ``partial_rotary_factor`` of each
head's dims (rotate-half pairs, as megatron-core's non-interleaved rope with
``rotary_percent``); dense first layers (``first_k_dense_replace``), then MoE layers of a
shared expert and routed experts picked by a sigmoid router with an expert bias
(``e_score_correction_bias``), renormalised top-k weights scaled by ``routed_scaling_factor``
(megatron's sigmoid score function, expert bias, topk scaling factor).

What transformers computes, not what the fields suggest:
  - its router always sums the top-2 biased scores of a group to rank the groups (megatron-core:
    the top ``topk // group_topk``); with ``n_group`` 1 groups play no part;
  - it keeps ``gate.weight`` and ``e_score_correction_bias`` in fp32 and computes the router
    logits in fp32;
  - ``partial_rotary_factor`` defaults to 0.5 when config.json leaves it out (Glm4MoeConfig).
The checkpoints' multi-token prediction layer (HF layer ``num_hidden_layers``: enorm, hnorm,
eh_proj, a MoE decoder layer, shared_head.norm, and copies of the embedding and head) is named
as DeepSeek-V3's and converted with the same table (megatron-core's ``mtp.layers.k``), counted
from the weights. transformers drops it on load (``_keys_to_ignore_on_load_unexpected``), so
no transformers model computes it: the conversion of its tensors is checked bit for bit, not
against logits.
"""
from __future__ import annotations

from ..family import Family, register
from ..shape import ModelShape, MoEShape
from ..weights import Table
from ._common import (
    ATTENTION,
    DENSE_MLP,
    EXPERT_BIAS,
    MTP,
    PRE_MLP_NORM,
    QK_NORM,
    QKV_BIAS,
    ROUTED,
    SHARED_EXPERTS,
    decoder,
    dense_fields,
    dense_hf,
    mtp_aliases,
    partial_rotary,
)

DEFAULT_ROTARY = 0.5  # Glm4MoeConfig.__post_init__: kwargs.setdefault("partial_rotary_factor", 0.5)
HF_GROUP_TOP = 2  # transformers ranks a group by the sum of its top-2 biased scores


def _moe(cfg) -> MoEShape:
    n = cfg.n_group or 1
    return MoEShape(
        num_experts=cfg.n_routed_experts, topk=cfg.num_experts_per_tok, ffn_hidden_size=cfg.moe_intermediate_size,
        layers=tuple(i >= cfg.first_k_dense_replace for i in range(cfg.num_hidden_layers)),
        shared_ffn_hidden_size=cfg.moe_intermediate_size * cfg.n_shared_experts, score_function="sigmoid",
        topk_scaling_factor=float(cfg.routed_scaling_factor), expert_bias=True,
        **(dict(num_groups=n, group_topk=cfg.topk_group) if n > 1 else {}))


def from_hf(cfg) -> ModelShape:
    return ModelShape(architecture="Glm4MoeForCausalLM", qkv_bias=bool(cfg.attention_bias),
                      qk_norm=bool(cfg.use_qk_norm), rotary_fraction=partial_rotary(cfg, DEFAULT_ROTARY), moe=_moe(cfg),
                      **dense_fields(cfg))


def to_hf(shape: ModelShape) -> dict:
    m = shape.moe
    d = dense_hf(shape, "glm4_moe")
    d["rope_parameters"] = {**d["rope_parameters"], "partial_rotary_factor": shape.rotary_fraction}
    return {**d, "partial_rotary_factor": shape.rotary_fraction, "attention_bias": shape.qkv_bias,
            "use_qk_norm": shape.qk_norm, "n_routed_experts": m.num_experts, "num_experts_per_tok": m.topk,
            "moe_intermediate_size": m.ffn_hidden_size, "n_shared_experts": m.shared_ffn_hidden_size // m.ffn_hidden_size,
            "first_k_dense_replace": m.layers.index(True) if any(m.layers) else shape.num_layers,
            "routed_scaling_factor": m.topk_scaling_factor or 1.0, "n_group": m.num_groups or 1,
            "topk_group": m.group_topk or 1, "norm_topk_prob": True, "num_nextn_predict_layers": shape.mtp_layers}


def weights(shape) -> Table:
    return {**decoder(shape, ATTENTION, QKV_BIAS if shape.qkv_bias else {}, QK_NORM if shape.qk_norm else {},
                      PRE_MLP_NORM, DENSE_MLP, ROUTED, EXPERT_BIAS,
                      SHARED_EXPERTS if shape.moe.shared_ffn_hidden_size else {}), **MTP}


def problems(shape, cfg) -> list[str]:
    """What megatron-core's GPTModel would compute differently from transformers' Glm4Moe."""
    m, out = shape.moe, []
    if m.topk > 1 and not cfg.norm_topk_prob:
        out.append(f"norm_topk_prob=false with top-{m.topk} sigmoid routing: megatron-core always renormalises the "
                   "chosen sigmoid scores when topk > 1")
    if m.num_groups and m.topk // m.group_topk != HF_GROUP_TOP:
        out.append(f"group-limited routing (n_group={m.num_groups}, topk_group={m.group_topk}, num_experts_per_tok="
                   f"{m.topk}): megatron-core ranks a group by the sum of its top topk // group_topk = "
                   f"{m.topk // m.group_topk} scores, transformers' Glm4Moe by its top {HF_GROUP_TOP}")
    return out


GLM4_MOE_TINY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-05, "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
    "rope_theta": 1000000.0, "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": True,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "num_nextn_predict_layers": 0
}

# Megatron-LM checkpoint flags without an HF config (converters.megatron_args.megatron_features):
# partial rope tells it from Qwen2-MoE; GLM-4.5 has QK norm, GLM-4.5-Air not
SIGNATURE = {"mla": False, "moe": True, "shared_expert": True, "qk_norm": None, "qkv_bias": True, "partial_rope": True}

register(Family("glm4_moe", ("Glm4MoeForCausalLM",), from_hf, to_hf, weights, mtp_aliases, problems,
                megatron_signature=SIGNATURE, tiny={"glm4-moe-tiny": GLM4_MOE_TINY}))
